"""Synonym tables: the CSR table and its on-device lookup, its sources, WordNet's set-up."""
