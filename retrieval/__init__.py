"""Retrieval: corpus, encoders, faiss indexes and the Search-R1-compatible server. Imports nothing internal."""
