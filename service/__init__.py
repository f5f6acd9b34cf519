"""nobackfill: serve a new embedding model against a gallery frozen in the old model's space."""

import os

# torch and faiss each bring an OpenMP runtime; on a few cores their idle threads spin and steal the
# cores from each other (a 5k-item gallery build went from 12 s to 4.5 min). Idle threads sleep
# instead. Only a default: set before either library loads, and an explicit env value wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
