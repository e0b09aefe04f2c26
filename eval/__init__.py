"""draftforge.eval."""
