"""Precook: raw text in, packed and sharded token rows out, and the loader that reads them."""
