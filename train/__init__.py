"""draftforge.train."""
