"""draftforge: train DSpark speculative-decoding drafts against a live target."""

__version__ = "0.1.0"
