"""Side-by-side benchmarks of the draft chain (`python3 benchmarks/draft_chain.py`)."""
