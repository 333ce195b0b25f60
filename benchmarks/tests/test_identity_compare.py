"""The identity comparer on small hand-made trees: what it lets pass, and the real changes it catches."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from benchmarks.identity_compare import Comparison, main
from densekit.io.artefact import MANIFEST
from densekit.io.fingerprint import digest_of, file_digest, tree_checksums


def write(root: Path, files: dict[str, str | bytes]) -> Path:
    """Write `files` (relative path: text or bytes) under `root`."""
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
    return root


def safetensors(tensors: list[tuple[str, list[float]]], metadata: dict[str, str] | None = None) -> bytes:
    """A safetensors file of float32 vectors, written in the order given."""
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    body, offset = b"", 0
    for name, values in tensors:
        data = struct.pack(f"<{len(values)}f", *values)
        header[name] = {"dtype": "F32", "shape": [len(values)], "data_offsets": [offset, offset + len(data)]}
        body, offset = body + data, offset + len(data)
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + body


def verdicts(a: Path, b: Path) -> dict[str, str]:
    """Each file's status."""
    comparison = Comparison(a, b)
    return {rel: comparison.classify(rel).status for rel in comparison.files}


def exit_code(a: Path, b: Path) -> int:
    """What `identity_compare A B` exits with."""
    try:
        main([str(a), str(b)])
    except SystemExit as exit:
        return int(exit.code)
    return 0


BASE = {
    "collections/scifact/run.trec": "q1 Q0 d1 1 0.5 dense\n",
    "collections/scifact/emb/part.npy": b"\x93NUMPY\x01\x00vectors",
}


def test_identical_trees_are_identical(tmp_path: Path, capsys):
    a, b = write(tmp_path / "a", BASE), write(tmp_path / "b", BASE)
    assert set(verdicts(a, b).values()) == {"identical"}
    assert exit_code(a, b) == 0
    assert "| collections | 2 | 0 | 0 | 0 | 0 |" in capsys.readouterr().out


def test_json_differing_in_times_and_its_own_root_is_benign(tmp_path: Path):
    def scores(root: Path, seconds: float, created: str) -> str:
        return json.dumps({"nDCG@10": 0.5, "seconds": seconds, "encode_s": seconds, "created": created,
                           "about": {"embeddings": f"{root}/collections/scifact/emb"}})  # fmt: skip

    a = write(tmp_path / "a", {"collections/scores.json": scores(tmp_path / "a", 1.5, "05:00")})
    b = write(tmp_path / "b", {"collections/scores.json": scores(tmp_path / "b", 2.5, "06:00")})
    assert verdicts(a, b) == {"collections/scores.json": "benign"}
    write(b, {"collections/scores.json": scores(tmp_path / "b", 2.5, "06:00").replace("0.5", "0.51")})
    assert verdicts(a, b) == {"collections/scores.json": "unexplained"}
    assert exit_code(a, b) == 1


def test_safetensors_with_the_same_tensors_in_another_order_are_benign(tmp_path: Path):
    tensors = [("a.weight", [1.0, 2.0]), ("b.bias", [3.0])]
    a = write(tmp_path / "a", {"m/model.safetensors": safetensors(tensors)})
    b = write(tmp_path / "b", {"m/model.safetensors": safetensors(tensors[::-1])})
    assert a.joinpath("m/model.safetensors").read_bytes() != b.joinpath("m/model.safetensors").read_bytes()
    assert verdicts(a, b) == {"m/model.safetensors": "benign"}
    write(b, {"m/model.safetensors": safetensors([("b.bias", [3.0]), ("a.weight", [1.0, 2.5])])})
    assert verdicts(a, b) == {"m/model.safetensors": "unexplained"}
    write(b, {"m/model.safetensors": safetensors(tensors[::-1], {"format": "tf"})})
    assert verdicts(a, b) == {"m/model.safetensors": "unexplained"}
    # the metadata's entries in another order (as save_model writes shared names)
    a = write(tmp_path / "a", {"m/model.safetensors": safetensors(tensors, {"x": "1", "y": "2"})})
    b = write(tmp_path / "b", {"m/model.safetensors": safetensors(tensors, {"y": "2", "x": "1"})})
    assert Comparison(a, b).classify("m/model.safetensors").why.endswith("the metadata in another order")
    write(b, {"m/model.safetensors": safetensors(tensors, {"y": "2", "x": "3"})})
    assert verdicts(a, b) == {"m/model.safetensors": "unexplained"}


def test_a_one_byte_change_is_caught_and_reported(tmp_path: Path, capsys):
    a = write(tmp_path / "a", BASE)
    b = write(tmp_path / "b", {**BASE, "collections/scifact/emb/part.npy": b"\x93NUMPY\x01\x00vectorz"})
    assert verdicts(a, b)["collections/scifact/emb/part.npy"] == "unexplained"
    assert exit_code(a, b) == 1
    out = capsys.readouterr().out
    assert "| collections | 1 | 0 | 0 | 1 | 0 |" in out
    assert "unexplained: collections/scifact/emb/part.npy: bytes differ from offset 14" in out
    # in text, the first differing line
    write(b, {**BASE, "collections/scifact/run.trec": "q1 Q0 d2 1 0.5 dense\n"})
    assert (
        "line 1: q1 Q0 d1 1 0.5 dense != q1 Q0 d2 1 0.5 dense"
        in Comparison(a, b).classify("collections/scifact/run.trec").why
    )


def test_a_file_on_one_side_only_is_missing(tmp_path: Path, capsys):
    a = write(tmp_path / "a", BASE)
    b = write(tmp_path / "b", {**BASE, "quickstart/metrics.json": "{}"})
    assert verdicts(a, b)["quickstart/metrics.json"] == "missing"
    assert exit_code(a, b) == 1
    assert "| quickstart | 0 | 0 | 0 | 0 | 1 |" in capsys.readouterr().out


def model_and_record(root: Path, config: dict, weights: bytes) -> None:
    """A model folder, a manifest listing its files' checksums, and a step record holding the folder's
    digest as densekit computes it (its files but the manifest)."""
    write(root, {"run/model/config.json": json.dumps(config), "run/model/model.bin": weights,
                 "run/model/.hidden": str(root)})  # fmt: skip
    checksums = tree_checksums(root / "run/model")
    write(root, {f"run/model/{MANIFEST}": json.dumps({"checksums": checksums, "created": str(root)})})
    folder = digest_of(tree_checksums(root / "run/model", skip={MANIFEST}))
    config_file = file_digest(root / "run/model/config.json")
    write(root, {"run/.steps/train.json": json.dumps({"inputs": {"model": folder, "config": config_file}})})


def test_digests_of_a_folder_whose_files_are_benign_are_accepted(tmp_path: Path):
    a, b = tmp_path / "a", tmp_path / "b"
    model_and_record(a, {"hidden": 32, "created": "05:00"}, b"weights")
    model_and_record(b, {"hidden": 32, "created": "06:00"}, b"weights")
    assert verdicts(a, b) == {
        "run/.steps/train.json": "benign",
        "run/model/.hidden": "benign",  # the root path only
        "run/model/config.json": "benign",
        f"run/model/{MANIFEST}": "benign",
        "run/model/model.bin": "identical",
    }
    assert "run/model/" in Comparison(a, b).classify("run/.steps/train.json").why
    assert exit_code(a, b) == 0


def test_digests_of_a_folder_with_a_real_change_are_refused(tmp_path: Path):
    a, b = tmp_path / "a", tmp_path / "b"
    model_and_record(a, {"hidden": 32, "created": "05:00"}, b"weights")
    model_and_record(b, {"hidden": 32, "created": "06:00"}, b"weightz")
    found = verdicts(a, b)
    assert found["run/model/model.bin"] == "unexplained"
    assert found[f"run/model/{MANIFEST}"] == "unexplained"  # its checksum of model.bin
    assert found["run/.steps/train.json"] == "unexplained"  # the folder's digest
    assert exit_code(a, b) == 1


def test_a_card_changed_on_purpose_is_intended_with_the_digests_and_listings_of_it(tmp_path: Path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    for root, card in ((a, "base_model: /machine/path\n"), (b, "library_name: densekit\n")):
        write(root, {"run/model/README.md": card, "run/model/model.bin": b"weights"})
        listed = {"model.bin": file_digest(root / "run/model/model.bin")}
        if root == a:  # the card was checksummed before, not after
            listed["README.md"] = file_digest(root / "run/model/README.md")
        write(root, {f"run/model/{MANIFEST}": json.dumps({"checksums": listed})})
        folder = digest_of(tree_checksums(root / "run/model", skip={MANIFEST}))
        write(root, {"run/.steps/train.json": json.dumps({"inputs": {"model": folder}})})
    plain = verdicts(a, b)
    assert plain["run/model/README.md"] == "unexplained" and plain[f"run/model/{MANIFEST}"] == "unexplained"
    comparison = Comparison(a, b, {"*README.md": "cards rewritten"})
    assert {rel: comparison.classify(rel).status for rel in comparison.files} == {
        "run/.steps/train.json": "benign",
        "run/model/README.md": "intended",
        f"run/model/{MANIFEST}": "benign",
        "run/model/model.bin": "identical",
    }
    write(b, {"run/model/model.bin": b"weightz"})  # a real change stays one beside an intended card
    assert Comparison(a, b, {"*README.md": "cards"}).classify("run/model/model.bin").status == "unexplained"
    try:
        main([str(a), str(b), "--intended", "*README.md=cards rewritten"])
    except SystemExit as exit:
        assert exit.code == 1
    assert "intended: 1 file(s): cards rewritten" in capsys.readouterr().out


def test_a_digest_of_nothing_in_the_trees_is_not_explained(tmp_path: Path):
    a = write(tmp_path / "a", {"x.json": json.dumps({"weights": "sha256:" + "a" * 64})})
    b = write(tmp_path / "b", {"x.json": json.dumps({"weights": "sha256:" + "b" * 64})})
    assert verdicts(a, b) == {"x.json": "unexplained"}


def test_timings_and_curves_beside_a_benign_log(tmp_path: Path):
    def files(seconds: float, plot: bytes, loss: float = 0.25) -> dict[str, str | bytes]:
        return {
            "run/timings.json": json.dumps({"train": seconds}),
            "run/train/log.jsonl": json.dumps({"step": 1, "loss": loss, "elapsed_s": seconds}) + "\n",
            "run/train/training_curves.png": plot,
        }

    a, b = write(tmp_path / "a", files(1.0, b"png-a")), write(tmp_path / "b", files(2.0, b"png-b"))
    assert set(verdicts(a, b).values()) == {"benign"}
    write(b, files(2.0, b"png-b", loss=0.5))
    assert verdicts(a, b)["run/train/training_curves.png"] == "unexplained"
    write(b, {"run/timings.json": json.dumps({"train": 2.0, "extra": 1.0})})
    assert verdicts(a, b)["run/timings.json"] == "unexplained"


@pytest.mark.parametrize("model", ["/work/model-a", "/work/model-b"])
def test_run_records_must_agree_on_model_data_parts_and_steps(tmp_path: Path, model: str):
    def record(root: Path, model: str) -> dict[str, str]:
        seconds = 1.0 if root.name == "a" else 2.0
        saved = {"src": f"/src/{root.name}", "out": str(root), "model": model, "data": "/d",
                 "parts": ["quickstart"], "max_steps": 3, "timings": {"x": seconds}}  # fmt: skip
        return {"_identity_run.json": json.dumps(saved)}

    a = write(tmp_path / "a", record(tmp_path / "a", "/work/model-a"))
    b = write(tmp_path / "b", record(tmp_path / "b", model))
    expected = "benign" if model == "/work/model-a" else "unexplained"
    assert verdicts(a, b) == {"_identity_run.json": expected}


def test_cards_naming_paths_relatively_and_cut_digests_of_benign_folders_are_benign(tmp_path: Path):
    """Trees at other depths: a card names the base model outside the tree by a relative path from the
    folder holding its own, and an input folder by its path, its digest cut short and its size."""
    a, b = tmp_path / "a", tmp_path / "deeper" / "b"
    base = tmp_path / "base-model"

    def card(root: Path, cut: int = 28, size: str | None = None) -> str:
        digest = digest_of(tree_checksums(root / "run/module", skip={MANIFEST}))
        seen = Path(os.path.relpath(base, root / "run")).as_posix()
        size = size or f"{(root / 'run/module/card.md').stat().st_size / 1024:.2f} KiB"
        return (
            f"| base model | {seen} |\n| input | {root}/run/module | {digest[:cut]}... | 1 files, {size} |\n"
        )

    for root in (a, b):
        write(
            root, {"run/module/card.md": f"trained from {root}/run/examples.jsonl\n", "run/.keep.json": "{}"}
        )
        write(root, {"run/model/README.md": card(root), "run/.steps/x.json": json.dumps({str(root): 1})})
    assert (
        Path(os.path.relpath(base, a / "run")).as_posix() != Path(os.path.relpath(base, b / "run")).as_posix()
    )
    assert set(verdicts(a, b).values()) == {"benign", "identical"}
    write(b, {"run/model/README.md": card(b, size="9.99 KiB").replace("| base", "| the base")})
    assert verdicts(a, b)["run/model/README.md"] == "unexplained"  # not only sizes differ
    write(
        b,
        {"run/model/README.md": card(b).replace(str(tmp_path / "base-model"), "x").replace("../", "../../")},
    )
    assert verdicts(a, b)["run/model/README.md"] == "unexplained"  # another base model
    write(b, {"run/module/card.md": "trained from elsewhere\n"})
    write(b, {"run/model/README.md": card(b)})
    assert verdicts(a, b)["run/model/README.md"] == "unexplained"  # a folder that really changed


def test_a_moved_tree_reads_its_relative_paths_from_where_it_was_written(tmp_path: Path):
    base = tmp_path / "base-model"

    def tree(root: Path) -> Path:
        record = {"out": str(root), "model": str(base), "data": "/d", "parts": ["two-round"], "max_steps": 3}
        seen = Path(os.path.relpath(base, root / "run")).as_posix()
        return write(
            root, {"_identity_run.json": json.dumps(record), "run/model/README.md": f"| base | {seen} |\n"}
        )

    a, b = tree(tmp_path / "a"), tree(tmp_path / "x" / "b")  # b's card climbs one folder more
    moved = tmp_path / "y" / "z" / "w" / "b"
    moved.parent.mkdir(parents=True)
    b.rename(moved)
    assert verdicts(a, moved)["run/model/README.md"] == "benign"
    write(moved, {"run/model/README.md": "| base | ../../x/base-model |\n"})
    assert verdicts(a, moved)["run/model/README.md"] == "unexplained"
