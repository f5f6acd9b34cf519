"""The query path's units, one a module; service/pipeline/'s Pipeline runs them in order for each request.

job.py         Query, SearchJob (one request: what was asked, its profile, its rows and timings), the results
validation.py  the request limits and each query's checks, before any encoder runs; default_mode
embedding.py   both query embeddings: as given, from the cache, or from the two batchers at once
fallback.py    which mode answers each row after an all-zero encoder row
search.py      the head per row group, then one gallery search (on the pipeline's search pool)
"""

from service.query.job import Query, QueryResult, SearchJob, SearchOutcome

__all__ = ["Query", "QueryResult", "SearchJob", "SearchOutcome"]
