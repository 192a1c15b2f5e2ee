"""Small dependency-free helpers every layer may use (progress display)."""
