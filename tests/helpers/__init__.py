"""What several test modules share: fakes, builders, servers and reference runs (never tests)."""
