"""The benchmark scripts' own checks use the package tests' fixtures (tiny models, small collections)."""

from tests.conftest import beir_dir, make_beir, tiny_model, tiny_st_model  # noqa: F401 (fixtures)
