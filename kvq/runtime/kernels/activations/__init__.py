"""A8: INT8 activations into the decoder's linears (`a8.py`: kernel + reference)."""
