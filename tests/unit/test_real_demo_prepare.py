"""`demo --real`'s prepare: which steps run on a fresh folder, and on one prepared before the item store existed."""

from __future__ import annotations

from pathlib import Path

from service.commands.real_demo import RealDeployment, prepare


def steps(real: RealDeployment) -> list[str]:
    """The commands prepare runs, each as its first two words (it is given a runner that only records)."""
    ran: list[str] = []
    prepare(real, lambda *args: ran.append(" ".join(str(a) for a in args[:2])))
    return ran


def test_a_fresh_folder_builds_the_item_store_before_the_gallery_that_records_it(tmp_path: Path) -> None:
    ran = steps(RealDeployment(tmp_path))
    assert ran.index("realworld items") < ran.index("gallery build")
    assert ran[-2:] == [f"fit {tmp_path / 'support'}", f"eval {tmp_path / 'profile'}"]


def test_a_folder_prepared_before_the_item_store_keeps_its_gallery_and_profile(tmp_path: Path) -> None:
    real = RealDeployment(tmp_path)
    for done in (
        real.old_model, real.new_model, real.corpus / "corpus.json", tmp_path / "support" / "models.json",
        tmp_path / "test" / "models.json", tmp_path / "gallery-old.json", real.gallery / "gallery.json",
        real.profile / "profile.json",
    ):  # fmt: skip
        done.parent.mkdir(parents=True, exist_ok=True)
        done.mkdir() if done.name in ("minilm-static-256", "all-MiniLM-L6-v2") else done.write_text("{}")
    # Only what it lacks: the item store (the gallery is not rebuilt: it records none, the count is checked)
    # and the saved eval of the profile it already has.
    assert steps(real) == ["realworld items", f"eval {real.profile}"]
    (real.items).mkdir()
    (real.items / "items.json").write_text("{}")
    real.saved_eval.write_text("{}")
    assert steps(real) == []
