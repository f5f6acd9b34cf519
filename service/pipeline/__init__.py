"""The query path without HTTP, in three rooms.

parts.py       every serving part acquired on one AsyncExitStack (encoders, gallery, profile, segment,
               item store, cache, sampler, hit counter, search pool, batchers, cascade), released last first
admission.py   whether a search comes in now (in flight, expected queue wait) and the ticket it carries
query_path.py  the Pipeline: validate, admit, embed, transform and search, re-rank, sample; profile hot swap
"""

from service.pipeline.parts import cache_model_key
from service.pipeline.query_path import Pipeline
from service.query.job import Query, QueryResult, SearchOutcome
from service.query.validation import default_mode

__all__ = ["Pipeline", "Query", "QueryResult", "SearchOutcome", "cache_model_key", "default_mode"]
