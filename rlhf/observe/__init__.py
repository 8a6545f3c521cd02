"""What a run shows while and after it trains: metrics, curves, profiles, runs side by side."""
