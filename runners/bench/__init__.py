"""llama-bench's method: sweeps of engine settings (sweep), the timed tests (measure), their
records (results), LocalScore's scenarios (localscore) and the tuning search (tuning)."""
