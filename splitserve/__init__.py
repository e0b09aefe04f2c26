"""draftforge.splitserve."""
