"""A small synthetic retrieval task to train on: topics, documents about them, questions about them."""

from __future__ import annotations

from pathlib import Path

from densekit.data.examples import TrainingExample, write_examples

from .conftest import write_beir

TOPICS = [
    "volcano lava eruption", "python programming code", "cat kitten purr", "bank money loan",
    "football goal match", "rain cloud weather", "piano music chord", "bread flour oven",
    "moon orbit planet", "doctor hospital patient", "train railway station", "forest tree leaf",
]  # fmt: skip


def write_training_collection(root: Path) -> tuple[Path, Path]:
    """A BEIR folder with 3 documents per topic and one query per topic, and a training file.

    Each example's positive is its topic's first document; its negatives are other topics' documents.
    """
    corpus, queries, train, test = [], [], [], []
    for t, topic in enumerate(TOPICS):
        words = topic.split()
        for d in range(3):
            corpus.append(
                {"_id": f"t{t}d{d}", "title": words[d % 3], "text": f"a text about {topic} number {d}"}
            )
        queries.append({"_id": f"q{t}", "text": f"question about {words[0]} and {words[1]}"})
        train.append((f"q{t}", f"t{t}d0", 1))
        test.append((f"q{t}", f"t{t}d1", 1))
    write_beir(root, corpus, queries, {"train": train, "test": test})
    examples = [
        TrainingExample(
            query_id=f"q{t}",
            query=queries[t]["text"],
            positives=[f"t{t}d0", f"t{t}d2"] if t % 2 else [f"t{t}d0"],
            negatives=[f"t{(t + k) % len(TOPICS)}d{k % 3}" for k in range(1, 5)],
        )
        for t in range(len(TOPICS))
    ]
    write_examples(root / "train.jsonl", examples)
    return root, root / "train.jsonl"
