"""Moving items into the new-model segment: hit counts (hits.py), the run (run.py), its plan and status."""
