"""The upgrade decision's two thresholds, in a module of their own so `nobackfill --help` need not load torch.

`assess` shows them as its option defaults; importing them from scoring/assess.py (which reaches
torch through compat/metrics.py) made every CLI call, an argument error included, take 2 s.
"""

# Below 2 points of R@10 a re-index buys less than one query in fifty; an operator upgrades for more.
MIN_GAIN = 0.02
# A bridge that keeps 95 % of the re-indexed R@10 (its lower bound) leaves too little to backfill for.
MIN_RETENTION = 0.95
