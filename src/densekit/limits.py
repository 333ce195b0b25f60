"""Bounds on the settings that size an allocation, shared by the commands (typer's `max`) and the
library that checks them; constants only, so that the command line imports nothing heavy for them.
docs/hostile-input.md lists them."""

# The most documents a command ranks per query (--k, a step's k, fuse's and diagnose-negatives'
# --depth): a run holds queries x k entries, so an absurd k is an absurd allocation; TREC ranks 1000.
MAX_RUN_DEPTH = 100_000

# The sign flips of the randomisation test (`compare --trials`): ten million take a minute or so, and
# more would only run longer (the p-value's error is already below 0.0002).
DEFAULT_TRIALS = 100_000
MAX_TRIALS = 10_000_000

# The most pseudo-queries one document gives (span, keywords): crops of one text repeat long before.
MAX_PER_DOCUMENT = 1000

# The widest vector a model folder's Dense module may declare: its weight matrix is in x out floats,
# so the width bounds what a hostile config.json can make densekit allocate (the widest published
# embedding models make 4,096 to 8,192 dimensions).
MAX_MODEL_WIDTH = 16_384

# The most corpus vectors `rotate` fits on: a d x d sum, so rows cost time, not memory.
MAX_ROTATION_SAMPLE = 10_000_000
# A ranking fit of a rotation scores each anchor against every corpus vector of its sample once and
# holds the sample in memory (200,000 x 1,024 floats: 0.8 GB).
MAX_RANKING_CANDIDATES = 200_000
MAX_RANKING_ANCHORS = 20_000
