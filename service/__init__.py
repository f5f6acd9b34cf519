"""nobackfill: serve a new embedding model against a gallery frozen in the old model's space."""

import os

from service.cpu_limit import omp_threads_default

# torch and faiss each bring an OpenMP runtime; on a few cores their idle threads spin and steal the
# cores from each other (a 5k-item gallery build went from 12 s to 4.5 min). Idle threads sleep
# instead. Only a default: set before either library loads, and an explicit env value wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# In a container OpenMP counts the node's cores, not the CPU limit (service/cpu_limit.py): cap both
# libraries' pools at the limit, only when there is one below the cores; an explicit env value wins.
_omp_threads = omp_threads_default()
if _omp_threads is not None:
    os.environ.setdefault("OMP_NUM_THREADS", _omp_threads)

__version__ = "0.1.0"
