"""draftforge.data."""
