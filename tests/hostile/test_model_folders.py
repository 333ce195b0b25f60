"""Hostile model, module, route, cross-encoder and index folders (issue 50, cases 11, 12, 13, 18, 21, 22,
23, 26, 29, 31, 32, 33, 38, then attacks of our own): each is refused in one line naming the file (and
line) or the option, before anything large is allocated, and nothing of the user's is written."""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from pydantic import TypeAdapter

from densekit.diagnostics import DataError
from densekit.index import IndexSpec, SearchIndex, SpecError, build_index
from densekit.index import memory as memory_module
from densekit.io.artefact import MANIFEST, read_manifest
from densekit.io.fingerprint import file_digest
from densekit.models import DenseEncoder
from densekit.models.cross_encoder import CrossEncoder
from densekit.models.modules.kinds.sparse_diff import choose_sparse_indices, sparse_targets
from densekit.models.modules.module import ModuleError
from densekit.models.modules.specs import ModuleSpec
from densekit.routing.hypernetwork import HyperSpec, LoraHypernetwork
from densekit.routing.route import Route
from densekit.routing.strategies import RouteSpec

from ..conftest import write_beir
from ..test_index import fake_store
from .commands import cli

SPEC = TypeAdapter(ModuleSpec)


def one_line_error(code: int, err: str, *expected: str) -> str:
    """The command stopped with status 2 on one error line, the last it printed, holding each of
    `expected`, and no traceback."""
    assert code == 2, err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:") or ": error: " in line]
    assert len(errors) == 1 and err.rstrip().endswith(errors[0]), err
    for text in expected:
        assert text in errors[0], errors[0]
    return errors[0]


def one_line(err: Exception, *expected: str) -> str:
    """`err`'s message: one line holding each of `expected`."""
    text = str(err)
    assert "\n" not in text, text
    for part in expected:
        assert part in text, text
    return text


def resign(folder: Path) -> None:
    """Record every file's present bytes in the folder's manifest, as a tool that recomputes checksums
    would: what densekit must still refuse is then in the files, not in their checksums."""
    manifest = read_manifest(folder)
    manifest.checksums = {name: file_digest(folder / name) for name in manifest.checksums}
    (folder / MANIFEST).write_text(manifest.to_json())


def edit_json(path: Path, change) -> None:
    """Rewrite the JSON file `path` with `change` applied to its value, indented as densekit writes."""
    value = json.loads(path.read_text())
    change(value)
    path.write_text(json.dumps(value, indent=2))


def put_module(encoder: DenseEncoder, spec: dict, seed: int = 0):
    """A module of `spec` on `encoder`, its parameters moved away from their start."""
    spec = SPEC.validate_python(spec)
    indices = None
    if spec.type == "sparse_diff":
        generator = torch.Generator().manual_seed(seed)
        scores = {n: torch.rand(w.shape, generator=generator)
                  for n, w in sparse_targets(encoder.query_backbone, spec).items()}  # fmt: skip
        indices = {"query": choose_sparse_indices(scores, spec.density)}
    module = encoder.new_module(spec, indices)
    encoder.own = module.name  # saved with the model as its own
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tower in module.towers().values():
            for parameter in tower.own_parameters().values():
                parameter.add_(0.2 * torch.randn(parameter.shape, generator=generator))
    return module


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> dict[str, Path]:
    """Module folders on the tiny base (query LoRA `q`, adapter `ad`, sparse difference `sp`; two shared
    LoRA modules both called `s`, of other weights), a fixed route over `q` and `ad`, a hypernetwork,
    a cross-encoder and a collection."""
    root = tmp_path_factory.mktemp("hostile-models")
    made = {"data": write_beir(root / "data")}
    specs = {
        "q": {"type": "lora", "rank": 4, "towers": "query", "name": "q"},
        "ad": {"type": "adapter", "bottleneck": 8, "towers": "query", "name": "ad"},
        "sp": {"type": "sparse_diff", "density": 0.05, "name": "sp"},
        "s1": {"type": "lora", "rank": 4, "name": "s"},
        "s2": {"type": "lora", "rank": 4, "name": "s"},
    }
    for seed, (key, spec) in enumerate(specs.items()):
        encoder = DenseEncoder.load(tiny_model)
        put_module(encoder, spec, seed)
        encoder.save(root / key)
        made[key] = root / key
    encoder, _ = _two_modules(made)
    spec = RouteSpec(type="fixed", modules=["q", "ad"], domains={"x": "q", "y": "ad"})
    Route(encoder, spec).save(root / "route", {"q": made["q"], "ad": made["ad"]})
    made["route"] = root / "route"
    LoraHypernetwork(DenseEncoder.load(tiny_model), HyperSpec(domains=["a", "b"])).save(root / "hyper")
    made["hyper"] = root / "hyper"
    CrossEncoder.load(tiny_model, 48).save(root / "cross")
    made["cross"] = root / "cross"
    return made


def _two_modules(folders: dict[str, Path]) -> tuple[DenseEncoder, list[str]]:
    from densekit.routing.route import load_modules

    return load_modules([folders["q"], folders["ad"]])


def copy(folder: Path, tmp_path: Path, name: str = "copy") -> Path:
    """A copy of `folder` to damage."""
    target = tmp_path / name
    shutil.copytree(folder, target)
    return target


def run_file(path: Path) -> Path:
    """A TREC run over the fixture collection's documents."""
    path.write_text("".join(f"q{q} Q0 d{d} {d} {10 - d} x\n" for q in range(1, 5) for d in range(1, 6)))
    return path


# --- 11: a pickled checkpoint -----------------------------------------------------------------------


@pytest.mark.parametrize("payload", ["tensors", "a function"])
def test_11_a_pickled_checkpoint_is_refused_in_one_line_naming_it_and_never_unpickled(
    capsys, folders, tiny_model: Path, tmp_path: Path, payload: str
):
    model = copy(tiny_model, tmp_path, "pickled")
    state = safetensors.torch.load_file(model / "model.safetensors")
    (model / "model.safetensors").unlink()
    if payload == "a function":
        state["extra"] = len  # pickled by reference: torch's safe unpickler refuses it, with 70 lines
    torch.save(state, model / "pytorch_model.bin")
    code, err, _ = cli(capsys, "encode", model, folders["data"], "-o", tmp_path / "emb", "--no-progress")
    one_line_error(code, err, "pytorch_model.bin", "pickled", "convert it to safetensors")
    assert not (tmp_path / "emb").exists()


# --- 12: a module's damaged safetensors --------------------------------------------------------------


def _rewrite_header(path: Path, change) -> None:
    """Apply `change` to a safetensors file's JSON header, keeping its data."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    change(header)
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + length :])


def _corrupt_header(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[8:20] = b"{garbage!!!!"
    path.write_bytes(bytes(raw))


def _first(header: dict) -> str:
    return next(key for key in header if key != "__metadata__")


DAMAGE = {
    "corrupt header": _corrupt_header,
    "truncated": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    "header past the end": lambda p: p.write_bytes((10**9).to_bytes(8, "little") + p.read_bytes()[8:]),
    "five bytes": lambda p: p.write_bytes(b"\x01\x02\x03\x04\x05"),
    "absurd shape": lambda p: _rewrite_header(p, lambda h: h[_first(h)].update(shape=[10**12, 10**12])),
    "unknown dtype": lambda p: _rewrite_header(p, lambda h: h[_first(h)].update(dtype="Q7")),
    "integer weights": lambda p: _rewrite_header(p, lambda h: h[_first(h)].update(dtype="I32")),
    "NaN weights": lambda p: safetensors.torch.save_file(
        {k: torch.full_like(v, float("nan")) for k, v in safetensors.torch.load_file(p).items()}, p
    ),
    "a missing tensor": lambda p: safetensors.torch.save_file(
        dict(list(safetensors.torch.load_file(p).items())[1:]), p
    ),
    "an extra tensor": lambda p: safetensors.torch.save_file(
        {**safetensors.torch.load_file(p), "extra": torch.zeros(2)}, p
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
@pytest.mark.parametrize("module", ["q", "ad"])
def test_12_a_modules_damaged_weights_file_is_refused_in_one_line_naming_it(
    folders, tmp_path: Path, damage: str, module: str
):
    folder = copy(folders[module], tmp_path)
    weights = folder / "query" / ("adapter_model.safetensors" if module == "q" else "module.safetensors")
    DAMAGE[damage](weights)
    resign(folder)
    with pytest.raises(ValueError) as err:
        DenseEncoder.load(folder)
    one_line(err.value, str(weights))


def test_12_a_damaged_module_stops_the_command_in_one_line(capsys, folders, tmp_path: Path):
    folder = copy(folders["q"], tmp_path)
    _corrupt_header(folder / "query" / "adapter_model.safetensors")
    resign(folder)
    code, err, _ = cli(capsys, "encode", folder, folders["data"], "-o", tmp_path / "emb", "--no-progress")
    one_line_error(code, err, "adapter_model.safetensors", "not a readable safetensors file")


# --- 13, 22, 23, 33: Milvus ---------------------------------------------------------------------------


@pytest.fixture
def small_store(tmp_path: Path):
    """Eight unit vectors of 16 dimensions, as `densekit encode` writes them."""
    data = np.random.default_rng(5).standard_normal((8, 16)).astype(np.float32)
    return fake_store(tmp_path / "emb", data / np.linalg.norm(data, axis=1, keepdims=True))


@pytest.mark.parametrize("name", ["a" * 300, "9lives", "dash-name", "ünïcode"])
def test_13_a_collection_name_milvus_refuses_is_refused_before_milvus_is_asked(
    capsys, small_store, tmp_path: Path, name: str
):
    pytest.importorskip("milvus_lite")
    code, err, _ = cli(capsys, "index", small_store.folder, "-o", tmp_path / "index", "--backend", "milvus",
                    "--uri", tmp_path / "m.db", "--collection", name, "--no-progress")  # fmt: skip
    one_line_error(code, err, "--collection", "a letter or '_' first", "255 characters at most")
    assert not (tmp_path / "m.db").exists() and not (tmp_path / "index").exists()


def test_13_33_a_milvus_index_builds_without_a_grpc_traceback_and_milvus_errors_are_one_line(
    small_store, tmp_path: Path, monkeypatch, caplog
):
    pytest.importorskip("milvus_lite")
    from pymilvus import MilvusClient

    from densekit.index.backends.milvus_index import build_milvus_index

    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.INFO):
        build_milvus_index(small_store, tmp_path / "index", "rel.db", "docs", show_progress=False)
    noisy = [r for r in caplog.records if r.name.startswith("grpc") and r.levelno >= logging.INFO]
    assert not noisy, [r.getMessage() for r in noisy]
    index = SearchIndex.load(tmp_path / "index")
    MilvusClient(str(tmp_path / "rel.db")).drop_collection("docs")
    with pytest.raises(RuntimeError) as err:
        index.search(np.ones((1, 16), dtype=np.float32), 3)
    one_line(err.value, f"Milvus at {tmp_path / 'rel.db'}:")


def test_22_a_relative_milvus_uri_is_recorded_absolute(small_store, tmp_path: Path, monkeypatch):
    pytest.importorskip("milvus_lite")
    from densekit.index.backends.milvus_index import build_milvus_index

    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    build_milvus_index(small_store, tmp_path / "index", "rel.db", "docs", show_progress=False)
    meta = json.loads((tmp_path / "index" / "index.json").read_text())
    assert meta["uri"] == str(tmp_path / "work" / "rel.db")
    monkeypatch.chdir(tmp_path)  # elsewhere, the index still finds its database (and makes no other)
    assert SearchIndex.load(tmp_path / "index").search(np.ones((1, 16), dtype=np.float32), 2).scores.shape
    assert not (tmp_path / "rel.db").exists()


@pytest.mark.parametrize("kind", ["folder", "file"])
def test_23_a_milvus_uri_onto_a_folder_or_file_of_the_users_is_refused(
    capsys, small_store, tmp_path: Path, kind: str
):
    pytest.importorskip("milvus_lite")
    target = tmp_path / "photos.db"
    if kind == "folder":
        target.mkdir()
        (target / "holiday.jpg").write_bytes(b"jpeg")
    else:
        target.write_bytes(b"mine")
    before = sorted(p.name for p in target.iterdir()) if kind == "folder" else target.read_bytes()
    code, err, _ = cli(capsys, "index", small_store.folder, "-o", tmp_path / "index", "--backend", "milvus",
                    "--uri", target, "--no-progress")  # fmt: skip
    one_line_error(code, err, "--uri", str(target))
    after = sorted(p.name for p in target.iterdir()) if kind == "folder" else target.read_bytes()
    assert after == before and not (tmp_path / "index").exists()


# --- 18, 38: index options ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [("hnsw_m", 100_000_000), ("hnsw_m", 1), ("ef_search", 2**31), ("ef_construction", 10**9),
     ("nlist", 10**12), ("nprobe", 10**30), ("pq_m", 10**30)],
)  # fmt: skip
def test_18_index_options_beyond_what_faiss_takes_are_refused_naming_the_option(field: str, value: int):
    """faiss crashes on an HNSW of M 1, wraps an ef of 2^31 to a negative number, and runs out of memory
    on an M of 10^8 (without the memory check)."""
    with pytest.raises(SpecError) as err:
        IndexSpec.checked(type="hnsw", **{field: value})
    assert err.value.field == field


def test_18_the_index_command_refuses_a_huge_hnsw_m_without_the_memory_check(capsys, small_store, tmp_path):
    code, err, _ = cli(capsys, "index", small_store.folder, "-o", tmp_path / "index", "--type", "hnsw",
                    "--hnsw-m", "100000000", "--no-memory-check", "--no-progress")  # fmt: skip
    assert code == 2 and "Invalid value for '--hnsw-m'" in err and "Traceback" not in err, err
    assert not (tmp_path / "index").exists()


def test_18_a_saved_hnsw_index_refuses_an_ef_search_faiss_would_wrap(small_store, tmp_path: Path):
    build_index(small_store, IndexSpec(type="hnsw"), tmp_path / "index", show_progress=False)
    index = SearchIndex.load(tmp_path / "index")
    with pytest.raises(SpecError, match="ef_search"):
        index.set_search_parameters(ef_search=2**31)


@pytest.mark.parametrize(
    ("spec", "named"),
    [(IndexSpec(type="hnsw", hnsw_m=1024), "--hnsw-m 1024 makes its graph"),
     (IndexSpec(type="flat"), "it holds every vector whole")],
)  # fmt: skip
def test_38_the_memory_check_names_the_option_that_makes_the_index_too_big(
    small_store, tmp_path: Path, monkeypatch, spec: IndexSpec, named: str
):
    monkeypatch.setattr(memory_module, "available_memory", lambda: (100, "a test's figure"))
    with pytest.raises(memory_module.IndexTooLarge) as err:
        build_index(small_store, spec, tmp_path / "index", show_progress=False)
    one_line(err.value, named, "--no-memory-check")


# --- 21, 32: rerank and score need a trained cross-encoder --------------------------------------------


@pytest.mark.parametrize("command", ["rerank", "score"])
def test_21_rerank_and_score_refuse_an_encoder_without_a_trained_head(
    capsys, folders, tiny_model: Path, tmp_path: Path, command: str
):
    if command == "rerank":
        args = [run_file(tmp_path / "bm25.trec"), folders["data"], "-o", tmp_path / "out.trec"]
    else:
        examples = tmp_path / "train.jsonl"
        example = {"query_id": "q2", "query": "programs", "positives": ["d8"], "negatives": ["d1"]}
        examples.write_text(json.dumps(example) + "\n")
        args = [examples, folders["data"], "-o", tmp_path / "out.jsonl"]
    code, err, _ = cli(capsys, command, tiny_model, *args, "--device", "cpu", "--no-progress")
    one_line_error(code, err, "no trained cross-encoder head", "train-cross-encoder")
    assert not (tmp_path / "out.trec").exists() and not (tmp_path / "out.jsonl").exists()


def test_21_a_trained_cross_encoder_folder_still_reranks(capsys, folders, tmp_path: Path):
    code, err, _ = cli(capsys, "rerank", folders["cross"], run_file(tmp_path / "bm25.trec"), folders["data"],
                    "-o", tmp_path / "out.trec", "--device", "cpu", "--no-progress")  # fmt: skip
    assert code == 0, err
    assert len((tmp_path / "out.trec").read_text().splitlines()) == 20


@pytest.mark.parametrize("folder", ["q", "route"])
def test_32_rerank_on_a_module_or_route_folder_says_what_it_is_and_what_rerank_takes(
    capsys, folders, tmp_path: Path, folder: str
):
    code, err, _ = cli(capsys, "rerank", folders[folder], run_file(tmp_path / "bm25.trec"), folders["data"],
                    "-o", tmp_path / "out.trec", "--device", "cpu", "--no-progress")  # fmt: skip
    kind = "module" if folder == "q" else "route"
    one_line_error(code, err, f"a densekit {kind} folder, not a cross-encoder folder", "train-cross-encoder")


# --- 26: ids reordered under a recomputed manifest -------------------------------------------------


def test_26_ids_reordered_under_a_recomputed_manifest_are_refused(small_store, tmp_path: Path):
    build_index(small_store, IndexSpec(), tmp_path / "index", show_progress=False)
    ids = tmp_path / "index" / "ids.txt"
    lines = ids.read_text().splitlines()
    ids.write_text("\n".join([lines[1], lines[0], *lines[2:]]) + "\n")
    resign(tmp_path / "index")
    with pytest.raises(DataError) as err:
        SearchIndex.load(tmp_path / "index")
    one_line(err.value, str(ids), "not the ids the index was built with")


# --- 29: unknown module types and route module names ------------------------------------------------


def test_29_an_unknown_module_type_in_a_module_file_is_one_line_naming_the_file_line_and_types(
    folders, tmp_path: Path
):
    folder = copy(folders["q"], tmp_path)
    edit_json(folder / "densekit-module.json", lambda d: d["spec"].update(type="nope"))
    resign(folder)
    with pytest.raises(DataError) as err:
        DenseEncoder.load(folder)
    where = f"{folder / 'densekit-module.json'}:2: error: spec"
    line = one_line(err.value, where, "'nope'", "'lora'", "'ia3'")
    assert "pydantic" not in line


def test_29_an_unknown_module_name_in_a_route_file_is_one_line_naming_the_file_and_the_modules(
    folders, tmp_path: Path
):
    folder = copy(folders["route"], tmp_path)
    edit_json(folder / "densekit-route.json", lambda d: d["spec"]["domains"].update(y="zzz"))
    resign(folder)
    with pytest.raises(DataError) as err:
        Route.load(folder)
    one_line(err.value, f"{folder / 'densekit-route.json'}:2: error: spec", "['zzz']", "['q', 'ad']")


def test_29_modules_route_with_an_unknown_module_name_names_the_option_and_the_modules(
    capsys, folders, tmp_path: Path
):
    code, err, _ = cli(capsys, "modules", "route", folders["q"], folders["ad"], "--domain", "x=q",
                    "--domain", "y=nope", "-o", tmp_path / "route")  # fmt: skip
    one_line_error(code, err, "--domain", "'nope'", "q, ad")
    assert not (tmp_path / "route").exists()


# --- 31: two modules of one name ---------------------------------------------------------------------


def test_31_a_module_of_a_loaded_modules_name_and_other_weights_is_refused_naming_both_folders(folders):
    encoder = DenseEncoder.load(folders["s1"])
    with pytest.raises(ModuleError) as err:
        encoder.load_module(folders["s2"])
    one_line(err.value, str(folders["s1"]), str(folders["s2"]), "'s'", "names of their own")
    assert encoder.load_module(folders["s1"]).name == "s"  # the same module again is no conflict


# --- attacks of our own --------------------------------------------------------------------------


CONFIGS = {
    "not JSON": ('{"model_type": "bert", oops', "malformed JSON"),
    "a JSON list": ("[1, 2]", "a JSON list where an object is expected"),
    "nested past recursion": ("[" * 100_000 + "]" * 100_000, "JSON nested too deeply"),
}


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_a_config_json_that_is_not_a_json_object_is_one_line_naming_it(tiny_model, tmp_path, kind):
    model = copy(tiny_model, tmp_path, "model")
    text, expected = CONFIGS[kind]
    (model / "config.json").write_text(text)
    with pytest.raises(DataError) as err:
        DenseEncoder.load(model)
    one_line(err.value, str(model / "config.json"), expected)


def test_a_tokenizer_json_that_is_not_json_is_one_line_naming_it(tiny_model, tmp_path):
    model = copy(tiny_model, tmp_path, "model")
    (model / "tokenizer.json").write_text("nope{")
    with pytest.raises(DataError) as err:
        DenseEncoder.load(model)
    one_line(err.value, f"{model / 'tokenizer.json'}:1: error: malformed JSON")


def test_a_tokenizer_with_tokens_the_model_cannot_embed_is_refused(tiny_model, tmp_path):
    model = copy(tiny_model, tmp_path, "model")
    edit_json(model / "config.json", lambda c: c.update(vocab_size=1000))
    state = safetensors.torch.load_file(model / "model.safetensors")
    state["embeddings.word_embeddings.weight"] = state["embeddings.word_embeddings.weight"][:1000]
    safetensors.torch.save_file(state, model / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(DataError) as err:
        DenseEncoder.load(model)
    one_line(err.value, "30522 tokens and the model embeds 1000")


def test_code_named_by_auto_map_does_not_run_without_trust_remote_code(capsys, folders, tiny_model, tmp_path):
    model = copy(tiny_model, tmp_path, "model")
    marker = tmp_path / "ran"
    remote = {"model_type": "evilbert", "auto_map": {"AutoModel": "evil.EvilModel"}}
    edit_json(model / "config.json", lambda c: c.update(remote))
    (model / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    code, err, _ = cli(capsys, "encode", model, folders["data"], "-o", tmp_path / "emb", "--no-progress")
    one_line_error(code, err, "config.json", "evil.EvilModel", "--trust-remote-code")
    assert not marker.exists()


@pytest.mark.parametrize(
    ("change", "expected"),
    [({"pooling": "nope"}, "pooling: Input should be 'cls', 'mean' or 'last'"),
     ({"query_max_length": -5}, "query_max_length: Input should be greater than 0")],
)  # fmt: skip
def test_a_densekit_json_with_bad_settings_is_one_line_naming_the_file_and_line(
    tiny_model, tmp_path, change, expected
):
    model = copy(tiny_model, tmp_path, "model")
    (model / "densekit.json").write_text(json.dumps({"normalize": True, **change}, indent=2))
    with pytest.raises(DataError) as err:
        DenseEncoder.load(model)
    one_line(err.value, f"{model / 'densekit.json'}:3: error: {expected}")


@pytest.mark.parametrize(
    ("spec", "expected"),
    [({"type": "lora", "rank": 10**9}, "rank 1000000000 would hold"),
     ({"type": "adapter", "bottleneck": 10**9}, "bottleneck 1000000000 would hold"),
     ({"type": "prompt", "virtual_tokens": 10**9}, "the base reads 128 positions"),
     ({"type": "prefix", "virtual_tokens": 10**6, "projection": True}, "the base reads 128 positions"),
     ({"type": "lora", "target_modules": ["nothing"]}, "['nothing'] matches no layer"),
     ({"type": "lora", "target_modules": ["attention"]}, "which no lora module adapts"),
     ({"type": "ia3", "target_modules": "(.*)*x"}, "'(.*)*x' matches no layer"),
     ({"type": "adapter", "ffn_output": "(.*)*x"}, "matches no layer"),
     ({"type": "adapter", "ffn_output": "encoder"}, "which no adapter module adapts")],
)  # fmt: skip
def test_a_module_that_would_not_fit_its_base_is_refused_before_anything_is_allocated(
    tiny_model, spec, expected
):
    """rank 10^9 would ask torch for 256 GB; `(.*)*x` would keep Python's `re` busy for years on one
    layer name; a target that is no linear layer would crash peft or the adapter's hook."""
    encoder = DenseEncoder.load(tiny_model)
    start = time.monotonic()
    with pytest.raises(ModuleError) as err:
        encoder.new_module(SPEC.validate_python(spec))
    one_line(err.value, expected)
    assert time.monotonic() - start < 10


def test_a_pattern_that_backtracks_without_end_never_reaches_pythons_re(tiny_model):
    """peft matches an IA3 pattern with `re`, which `(.*)*x` keeps busy for years on one layer name:
    densekit matches it first (with `regex`, under a deadline) and gives peft the names it found."""
    encoder = DenseEncoder.load(tiny_model)
    spec = {"type": "ia3", "target_modules": r"(.*)*x|.*\.(key|value)|.*output\.dense",
            "feedforward_modules": r"(.*)*y|.*layer\.\d+\.output\.dense"}  # fmt: skip
    start = time.monotonic()
    module = encoder.new_module(SPEC.validate_python(spec))
    assert time.monotonic() - start < 10
    plain = {"type": "ia3", "target_modules": r".*\.(key|value)|.*output\.dense",
             "feedforward_modules": r".*layer\.\d+\.output\.dense", "name": "plain"}  # fmt: skip
    same = encoder.new_module(SPEC.validate_python(plain))
    assert len(module.query_tower.own_parameters()) == 8  # key, value and two output.dense in each layer
    assert module.query_tower.own_parameters().keys() == same.query_tower.own_parameters().keys()


def test_a_module_file_asking_for_rank_10_9_is_refused_in_one_line(folders, tmp_path):
    folder = copy(folders["q"], tmp_path)
    edit_json(folder / "densekit-module.json", lambda d: d["spec"].update(rank=10**9))
    resign(folder)
    with pytest.raises(ModuleError) as err:
        DenseEncoder.load(folder)
    one_line(err.value, "'q'", "rank 1000000000")


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [("name", "a.b", "a module name is 1 to 100 letters"),
     ("ffn_output", "(", "is not a regular expression")],
)  # fmt: skip
def test_a_module_file_with_a_name_or_pattern_torch_or_re_would_crash_on_is_one_line(
    folders, tmp_path, field, value, expected
):
    folder = copy(folders["ad"], tmp_path)
    edit_json(folder / "densekit-module.json", lambda d: d["spec"].update({field: value}))
    resign(folder)
    with pytest.raises(DataError) as err:
        DenseEncoder.load(folder)
    one_line(err.value, str(folder / "densekit-module.json"), f"spec.adapter.{field}", expected)


@pytest.mark.parametrize("positions", ["out of range", "negative", "fractional"])
def test_a_sparse_difference_with_positions_outside_its_layer_is_refused_at_load(
    folders, tmp_path, positions
):
    folder = copy(folders["sp"], tmp_path)
    weights = folder / "module.safetensors"
    state = safetensors.torch.load_file(weights)
    key = next(k for k in state if k.endswith(".indices"))
    value = {"out of range": 10**9, "negative": -1, "fractional": 0.5}[positions]
    state[key] = state[key].to(torch.float32 if positions == "fractional" else state[key].dtype)
    state[key][-1] = value
    safetensors.torch.save_file(state, weights)
    resign(folder)
    with pytest.raises(ModuleError) as err:
        DenseEncoder.load(folder)
    one_line(err.value, "sparse difference of")


def test_a_module_given_with_module_that_is_no_module_folder_is_one_line(
    capsys, folders, tiny_model, tmp_path
):
    code, err, _ = cli(capsys, "encode", tiny_model, folders["data"], "-o", tmp_path / "emb", "--module",
                    folders["route"], "--no-progress")  # fmt: skip
    one_line_error(code, err, "a densekit route folder, not a module folder")


def test_a_route_finds_its_modules_by_a_relative_folder_from_the_route_not_the_working_one(
    folders, tmp_path, monkeypatch
):
    root = tmp_path / "moved"
    for name in ("route", "q", "ad"):
        shutil.copytree(folders[name], root / name)
    edit_json(root / "route" / "densekit-route.json",
              lambda d: [m.update(folder=f"../{n}") for n, m in d["modules"].items()])  # fmt: skip
    resign(root / "route")
    monkeypatch.chdir(tmp_path)
    assert Route.load(root / "route").spec.modules == ["q", "ad"]


@pytest.mark.parametrize("target", ["an index folder", "/etc"])
def test_a_route_naming_a_folder_that_is_no_module_is_refused_in_one_line(
    folders, small_store, tmp_path, target
):
    folder = copy(folders["route"], tmp_path, "route")
    if target == "an index folder":
        build_index(small_store, IndexSpec(), tmp_path / "index", show_progress=False)
        target = str(tmp_path / "index")
    edit_json(folder / "densekit-route.json", lambda d: d["modules"]["q"].update(folder=target))
    resign(folder)
    with pytest.raises(DataError) as err:
        Route.load(folder)
    one_line(err.value, target)


def test_a_route_of_a_million_modules_is_refused_before_any_is_loaded(folders, tmp_path):
    folder = copy(folders["route"], tmp_path)
    names = [f"m{i}" for i in range(10**4)]  # a million is refused by the file's size alone
    edit_json(folder / "densekit-route.json", lambda d: d["spec"].update(modules=names))
    resign(folder)
    start = time.monotonic()
    with pytest.raises(DataError) as err:
        Route.load(folder)
    one_line(err.value, "spec.fixed.modules: List should have at most 256 items")
    assert time.monotonic() - start < 20


def test_a_routers_weights_that_do_not_fit_are_refused_naming_the_file(folders, tmp_path):
    encoder, _ = _two_modules(folders)
    Route(encoder, RouteSpec(type="soft", modules=["q", "ad"])).save(
        tmp_path / "soft", {"q": folders["q"], "ad": folders["ad"]}
    )
    weights = tmp_path / "soft" / "router.safetensors"
    safetensors.torch.save_file({"scores.weight": torch.zeros(3, 32), "scores.bias": torch.zeros(3)}, weights)
    resign(tmp_path / "soft")
    with pytest.raises(DataError) as err:
        Route.load(tmp_path / "soft")
    one_line(err.value, str(weights), "of another shape")


def test_a_hypernetwork_file_of_other_shapes_is_refused_naming_it(folders, tmp_path):
    folder = copy(folders["hyper"], tmp_path)
    weights = folder / "hypernetwork.safetensors"
    state = safetensors.torch.load_file(weights)
    state["embeddings"] = torch.zeros(2, 5)
    safetensors.torch.save_file(state, weights)
    resign(folder)
    with pytest.raises(DataError) as err:
        LoraHypernetwork.load(folder)
    one_line(err.value, str(weights), "of another shape ['embeddings']")


def test_modules_generate_for_an_unknown_domain_is_one_line(capsys, folders, tmp_path):
    code, err, _ = cli(capsys, "modules", "generate", folders["hyper"], "--domain", "nope",
                       "-o", tmp_path / "m")  # fmt: skip
    one_line_error(code, err, "domain 'nope' is not one of this hypernetwork's: a, b")


@pytest.mark.parametrize(
    ("entry", "expected"),
    [({"path": "../elsewhere", "type": "sentence_transformers.models.Transformer"}, "leads outside"),
     ({"path": "/", "type": "sentence_transformers.models.Transformer"}, "leads outside")],
)  # fmt: skip
def test_a_sentence_transformers_modules_json_pointing_outside_its_folder_is_refused(
    tiny_st_model, tmp_path, entry, expected
):
    model = copy(tiny_st_model, tmp_path, "st")
    shutil.copytree(tiny_st_model, tmp_path / "elsewhere")
    edit_json(model / "modules.json", lambda m: m.__setitem__(0, {"idx": 0, "name": "0", **entry}))
    with pytest.raises(DataError) as err:
        DenseEncoder.load(model)
    one_line(err.value, str(model / "modules.json"), expected)


def test_a_sentence_transformers_modules_json_that_is_no_list_is_one_line(tiny_st_model, tmp_path):
    model = copy(tiny_st_model, tmp_path, "st")
    (model / "modules.json").write_text('{"path": ""}')
    with pytest.raises(DataError) as err:
        DenseEncoder.load(model)
    one_line(err.value, str(model / "modules.json"), "expected a JSON list of modules")


def test_a_model_holding_nan_weights_is_refused(tiny_model, tmp_path):
    model = copy(tiny_model, tmp_path, "model")
    state = safetensors.torch.load_file(model / "model.safetensors")
    state["encoder.layer.0.output.dense.bias"][0] = float("nan")
    safetensors.torch.save_file(state, model / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(DataError) as err:
        DenseEncoder.load(model)
    one_line(err.value, str(model), "'encoder.layer.0.output.dense.bias' holds NaN")
