"""The saved eval and `profile compare` results the profile view shows (api.ui_eval / api.ui_compare).

Read and checked once at startup (a file that is not one, or scores another profile, refuses the
start in one line: compat/saved.py); each look compares them with the profile served now, which an
admin reload may have replaced since.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from service.compat.saved import COMPARE_KIND, EVAL_KIND, read_document
from service.pipeline import Pipeline
from service.settings import ApiSettings


@dataclass(frozen=True)
class SavedResults:
    """The saved results given to the page, each None when not configured."""

    eval: dict[str, Any] | None = None
    compare: dict[str, Any] | None = None

    def shown(self, profile_id: str | None) -> dict[str, Any]:
        """The results that score `profile_id` (the served one), and a note for each that scores another."""
        out: dict[str, Any] = {"eval": None, "compare": None, "notes": []}
        for name, document in (("eval", self.eval), ("compare", self.compare)):
            if document is None:
                continue
            if document["profile_id"] == profile_id:
                out[name] = document
            else:
                out["notes"].append(
                    f"the saved {name} scores profile {document['profile_id']}, not the one served now "
                    f"({profile_id or 'none'}): it was reloaded since the start"
                )
        return out


def load_saved(settings: ApiSettings, pipeline: Pipeline) -> SavedResults:
    """Read and check the configured results against the served profile; ArtifactError in one line."""
    served = None if pipeline.profile is None else pipeline.profile.profile_id
    return SavedResults(
        eval=None if settings.ui_eval is None else read_document(settings.ui_eval, EVAL_KIND, served, "api.ui_eval"),
        compare=None
        if settings.ui_compare is None
        else read_document(settings.ui_compare, COMPARE_KIND, served, "api.ui_compare"),
    )
