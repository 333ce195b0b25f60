"""Contrastive fine-tuning (DPR / Tevatron style): InfoNCE over in-batch and hard negatives.

A step's global batch holds B queries, each with a group of n passages (its positive first, then
n-1 hard negatives). Every query is scored against all B·n passages, gathered from every process, so
the other queries' passages serve as in-batch negatives; the loss is cross-entropy with the query's
own positive as the target, scores divided by the temperature.

False negatives: a passage that is one of the query's known positives (another of its judged
documents, or a copy of its own positive in another query's group) is not a negative. With
`loss.mask_false_negatives` (the default) such passages are left out of the query's softmax.

Several positives (`loss.multi_positive`, with `data.positives` of them first in each group): the
query's loss is the mean, over the distinct known positives of it among the batch's passages, of one
InfoNCE term each, -s_ij + logsumexp over j and every passage that is not a known positive of the
query. A document that is there several times (a repeated positive, or a copy in another group)
has one term, on its first column in the query's own group, else its first in the batch.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from densekit.data.examples import TrainingExample
from densekit.device import autocast, to_device
from densekit.errors import InputError
from densekit.models.dimensions import truncated
from densekit.models.encoder import DenseEncoder
from densekit.routing.hypernetwork import LoraHypernetwork
from densekit.routing.route import Route
from densekit.training import distributed
from densekit.training.config import INNER_PRODUCT_TEMPERATURE, NORMALIZED_TEMPERATURE, TrainConfig
from densekit.training.grad_cache import cached_backward, split_inputs
from densekit.training.grouped_task import GroupedExamplesTask
from densekit.training.log import Figure, device_figure
from densekit.training.passage_vectors import PassageVectors
from densekit.training.sampling import (
    global_batch_rows,
    local_batch_rows,
)

log = logging.getLogger("densekit")

VECTORS = "vectors"  # a batch's passages given as saved vectors rather than tokens


@dataclass
class ContrastiveBatch:
    """This process's share of a step: queries, and their passage groups laid out query by query."""

    queries: dict[str, torch.Tensor]
    passages: dict[str, torch.Tensor]
    group_size: int
    # (queries x passages) True where a passage is one of the query's known positives but not one of
    # its targets, over the whole global batch when negatives are gathered across processes; None: none
    false_negatives: torch.Tensor | None = None
    # (queries x group_size) the teacher's score of each query's group, positive first; None: no
    # distillation
    teacher: torch.Tensor | None = None
    # the batch's one domain, with domain batching; None otherwise
    domain: str | None = None
    # (queries x passages), with loss.multi_positive: True at the column of each distinct known positive
    # of the query (its targets), over the same batch as false_negatives; None: its first passage alone
    positives: torch.Tensor | None = None

    @property
    def size(self) -> int:
        """Queries in the batch."""
        return int(self.queries["input_ids"].shape[0])

    def to(self, device: torch.device) -> ContrastiveBatch:
        """The batch with its tensors on `device`, copied without waiting for the GPU (`to_device`)."""

        def moved(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else to_device(tensor, device)

        return dataclasses.replace(
            self, queries={k: moved(v) for k, v in self.queries.items()},
            passages={k: moved(v) for k, v in self.passages.items()},
            false_negatives=moved(self.false_negatives), teacher=moved(self.teacher),
            positives=moved(self.positives),
        )  # fmt: skip


def contrastive_loss(
    queries: torch.Tensor,
    passages: torch.Tensor,
    group_size: int,
    temperature: float,
    cross_device: bool,
    false_negatives: torch.Tensor | None = None,
    positives: torch.Tensor | None = None,
) -> torch.Tensor:
    """InfoNCE of each query against every passage (gathered across processes when `cross_device`).

    Query i's positive is passage i·group_size; passages where `false_negatives` is True (for the
    gathered batch when `cross_device`) are left out of the query's softmax. With `positives`, a
    (queries x passages) mask of each query's targets instead, the loss is `multi_positive_loss`. Under
    several processes the loss is weighted for the average of gradients that follows
    (`distributed.gathered_loss_weight`).
    """
    if cross_device:
        queries, passages = distributed.gather_with_grad(queries), distributed.gather_with_grad(passages)
    if queries.dtype in (torch.float16, torch.bfloat16):
        queries, passages = queries.float(), passages.float()
    scores = queries @ passages.T / temperature
    if false_negatives is not None:
        false_negatives = false_negatives.to(scores.device)
    if positives is not None:
        loss = multi_positive_loss(scores, positives.to(scores.device), false_negatives)
    else:
        if false_negatives is not None:
            scores = scores.masked_fill(false_negatives, float("-inf"))
        targets = torch.arange(scores.shape[0], device=scores.device) * group_size
        loss = F.cross_entropy(scores, targets)
    return loss * distributed.gathered_loss_weight() if cross_device else loss


def multi_positive_loss(
    scores: torch.Tensor, positives: torch.Tensor, false_negatives: torch.Tensor | None = None
) -> torch.Tensor:
    """The mean over queries of the mean over each query's targets j of -s_ij + logsumexp over j and
    the query's negatives; `scores` is (queries x passages), already divided by the temperature.

    `positives` marks each query's targets (at least one per query), `false_negatives` its other
    known positives: neither is a negative of any of its terms. A query with no negative at all in
    the batch has a loss of 0.
    """
    known = positives if false_negatives is None else positives | false_negatives
    negatives = torch.logsumexp(scores.masked_fill(known, float("-inf")), dim=1)
    # -s + log(e^s + e^n) = softplus(n - s), with n the logsumexp of the query's negatives
    terms = F.softplus(negatives[:, None] - scores)
    per_query = torch.where(positives, terms, 0.0).sum(dim=1) / positives.sum(dim=1)
    return per_query.mean()


def score_alignment_loss(
    student: torch.Tensor, teacher: torch.Tensor, left_out: torch.Tensor | None = None
) -> torch.Tensor:
    """KL(softmax(teacher) || softmax(student)) over each query's row of in-batch scores (both already
    divided by the temperature), averaged over queries; entries where `left_out` is True are in
    neither softmax. The teacher gets no gradient."""
    teacher = teacher.detach()
    if left_out is not None:
        left_out = left_out.to(student.device)
        student, teacher = (scores.masked_fill(left_out, float("-inf")) for scores in (student, teacher))
    log_student, log_teacher = F.log_softmax(student, dim=1), F.log_softmax(teacher, dim=1)
    # written out rather than F.kl_div: an entry left out is -inf in both, and 0 * (-inf - -inf) is nan
    terms = log_teacher.exp() * (log_teacher - log_student)
    if left_out is not None:
        terms = terms.masked_fill(left_out, 0.0)
    return terms.sum(dim=1).mean()


def group_scores(queries: torch.Tensor, passages: torch.Tensor, group_size: int) -> torch.Tensor:
    """Each query's scores for its own group of passages: (queries x group_size), positive first."""
    if queries.dtype in (torch.float16, torch.bfloat16):
        queries, passages = queries.float(), passages.float()
    grouped = passages.view(queries.shape[0], group_size, -1)
    return torch.einsum("qd,qgd->qg", queries, grouped)


def margin_mse_loss(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Hofstaetter et al.'s Margin-MSE: the mean squared difference between the student's and the
    teacher's margins, positive minus each negative of the group."""
    return F.mse_loss(student[:, :1] - student[:, 1:], teacher[:, :1] - teacher[:, 1:])


def kl_distillation_loss(
    student: torch.Tensor, teacher: torch.Tensor, temperature: float, teacher_temperature: float
) -> torch.Tensor:
    """KL(teacher || student) between the softmaxes over each query's group, averaged over queries."""
    return F.kl_div(
        F.log_softmax(student / temperature, dim=-1),
        F.log_softmax(teacher / teacher_temperature, dim=-1),
        log_target=True,
        reduction="batchmean",
    )


class ContrastiveTask(GroupedExamplesTask):
    """What the trainer needs for contrastive fine-tuning: batches, forward and backward, export."""

    def __init__(
        self,
        encoder: DenseEncoder,
        examples: list[TrainingExample],
        texts: dict[str, str],
        config: TrainConfig,
        route: Route | None = None,
        module_folders: dict[str, str] | None = None,
        hypernetwork: LoraHypernetwork | None = None,
        passage_vectors: PassageVectors | None = None,
    ):
        self.encoder = encoder
        # saved vectors of the base's passages, for a run whose passages stay the base's
        self.passage_vectors = passage_vectors
        # with a route, only its router trains: queries are routed among frozen modules, passages are
        # the base's; with a hypernetwork, only it trains: queries go through its batch's domain's module
        self.route = route
        self.module_folders = module_folders or {}
        self.hypernetwork = hypernetwork
        self.module = route or hypernetwork or encoder
        self._token_counts: dict[str, int] = {}
        super().__init__(examples, texts, config)
        self.temperature = config.loss.temperature_for(encoder.config.normalize)
        if not encoder.config.normalize and self.temperature < 0.5:
            log.warning(
                "loss.temperature %g with unnormalised embeddings: raw inner products (often in the tens "
                "or hundreds) divided by it saturate the softmax; %g suits cosine similarity (set "
                "model.normalize: true), DPR's unnormalised training uses %g (the default without it)",
                self.temperature, NORMALIZED_TEMPERATURE, INNER_PRODUCT_TEMPERATURE,
            )  # fmt: skip
        if config.loss.distillation != "none":
            _check_teacher_scores(examples, config)
        if route is None and hypernetwork is None:  # what is saved is the encoder (or its module)
            self._record_matryoshka(config)
        batch = config.optim.batch_size
        left_over = len(examples) % batch
        if left_over:
            log.info(
                "each epoch trains on %d of %d examples in %d full batches; the %d left over change with "
                "each epoch's shuffle",
                len(examples) - left_over, len(examples), len(examples) // batch, left_over,
            )  # fmt: skip

    def _record_matryoshka(self, config: TrainConfig) -> None:
        """Check `loss.matryoshka`'s widths against the encoder's vectors and record them in its settings,
        which the saved model (or module) keeps; a run without it records none, whatever the model it
        started from was trained for. Training moves what each dimension holds, so a start rotated by a
        corpus's variance (`densekit rotate`) is no longer recorded as ordered."""
        matryoshka = config.loss.matryoshka
        width = self.encoder.dimension
        if matryoshka is not None:
            if matryoshka.dims[0] > width:
                raise InputError(
                    f"loss.matryoshka.dims: {matryoshka.dims[0]} is more than the {width} dimensions of "
                    f"{config.model.path}'s vectors; give widths of {width} or fewer"
                )
            if matryoshka.dims[0] < width:
                log.warning(
                    "loss.matryoshka.dims %s leaves out the model's full width %d: its full vectors are not "
                    "trained, so use it only at the widths trained", matryoshka.dims, width,
                )  # fmt: skip
        dims = None if matryoshka is None else matryoshka.dims
        update = {"matryoshka_dims": dims, "variance_ordered": False}
        self.encoder.config = self.encoder.config.model_copy(update=update)

    def set_examples(self, examples: list[TrainingExample]) -> None:
        """Train on new negatives (ANCE) for the same queries, in the same order."""
        if [e.query_id for e in examples] != [e.query_id for e in self.examples]:
            raise InputError("new examples must hold the same queries in the same order")
        self._use_examples(examples)

    def batch(self, epoch: int, step: int) -> ContrastiveBatch:
        """This process's part of global batch `step` of `epoch`."""
        rows = local_batch_rows(
            len(self.examples), self.config.optim.batch_size, epoch, step, self.config.seed,
            self.grouping(epoch),
        )  # fmt: skip
        query_texts, passage_ids, teacher = [], [], []
        for index in rows:
            example = self.examples[int(index)]
            documents = self.sampler.group(int(index), epoch).documents
            query_texts.append(example.query)
            passage_ids.extend(documents)
            if self.config.loss.distillation != "none":
                teacher.append(_teacher_scores(example, documents))
        if self.passage_vectors is not None:
            passages = {VECTORS: self.passage_vectors(passage_ids)}
        else:
            texts = [self.texts[doc_id] for doc_id in passage_ids]
            passages = self.encoder.pad(self.encoder.tokenize(texts, "passage"))
        loss = self.config.loss
        targets, false_negatives = (
            self.known_positives(epoch, step) if loss.mask_false_negatives else (None, None)
        )
        return ContrastiveBatch(
            self.encoder.pad(self.encoder.tokenize(query_texts, "query")),
            passages,
            self.config.data.group_size,
            false_negatives if false_negatives is not None and bool(false_negatives.any()) else None,
            torch.tensor(teacher, dtype=torch.float32) if teacher else None,
            self.examples[int(rows[0])].domain if self.config.data.batches == "by_domain" else None,
            targets if loss.multi_positive else None,
        )

    def group_lengths(self, epoch: int) -> np.ndarray:
        """Each example's length in `epoch`: the token count (after truncation) of the longest passage
        of its group, which is what the batch is padded to."""
        groups = [self.sampler.group(i, epoch).documents for i in range(len(self.examples))]
        unknown = sorted({d for documents in groups for d in documents} - self._token_counts.keys())
        counts = self.encoder.tokenize([self.texts[d] for d in unknown], "passage") if unknown else []
        self._token_counts.update((d, len(ids)) for d, ids in zip(unknown, counts, strict=True))
        return np.array([max(self._token_counts[d] for d in documents) for documents in groups])

    def false_negatives(self, epoch: int, step: int) -> torch.Tensor | None:
        """Where a passage of the batch is a known positive of a query other than one of its targets
        (`known_positives`); None when there is no such passage."""
        mask = self.known_positives(epoch, step)[1]
        return mask if bool(mask.any()) else None

    def known_positives(self, epoch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the batch's passages are its queries' known positives, as two (queries x passages)
        masks: each query's targets, and its other known positives (the false negatives). Over the
        global batch when negatives are gathered across processes, else this process's part; every
        process computes them alike from (seed, epoch, step).

        The target is the query's first passage, or with `loss.multi_positive` one column per
        distinct known positive in the batch: its first in the query's own group, else its first in
        the batch; every other column holding it is a false negative.
        """
        optim, size = self.config.optim, self.config.data.group_size
        rows = global_batch_rows(
            len(self.examples), optim.batch_size, epoch, step, self.config.seed, self.grouping(epoch)
        )
        if not self.config.loss.cross_device_negatives:
            local = len(rows) // distributed.world_size()
            rows = rows[distributed.rank() * local : (distributed.rank() + 1) * local]
        columns: dict[str, list[int]] = {}
        for i, index in enumerate(rows):
            for offset, doc_id in enumerate(self.sampler.group(int(index), epoch).documents):
                columns.setdefault(doc_id, []).append(i * size + offset)
        known = torch.zeros((len(rows), len(rows) * size), dtype=torch.bool)
        targets = torch.zeros_like(known)
        for i, index in enumerate(rows):
            own = range(i * size, (i + 1) * size)
            for doc_id in set(self.examples[int(index)].positives):
                found = columns.get(doc_id, [])
                known[i, found] = True
                if self.config.loss.multi_positive and found:
                    targets[i, next((c for c in found if c in own), found[0])] = True
            if not self.config.loss.multi_positive:
                targets[i, i * size] = True
        return targets, known & ~targets

    def _encode(self, side: str, domain: str | None = None):
        device = self.encoder.device
        precision = self.config.optim.precision

        def encode(
            inputs: dict[str, torch.Tensor], with_chunk_loss: bool = False
        ) -> tuple[torch.Tensor, None]:
            if VECTORS in inputs:  # saved passage vectors: nothing to encode, nothing to train
                return inputs[VECTORS].to(device=device, dtype=self.encoder.query_backbone.dtype), None
            input_ids, attention_mask = inputs["input_ids"].to(device), inputs["attention_mask"].to(device)
            with autocast(device, precision):
                if self.route is not None and side == "query":
                    vectors = self.route(input_ids, attention_mask)
                elif self.hypernetwork is not None and side == "query":
                    embedding = self.hypernetwork.embedding(domain)
                    vectors = self.hypernetwork.encode(embedding, input_ids, attention_mask)
                else:
                    vectors = self.encoder(input_ids, attention_mask, side=side)
            return vectors, None

        return encode

    def _loss(
        self, queries: torch.Tensor, passages: torch.Tensor, scale: float, batch: ContrastiveBatch
    ) -> torch.Tensor:
        """`scale` times the weighted sum of InfoNCE and the distillation term, or with
        `loss.matryoshka` the weighted sum over its widths of that sum on the vectors cut to each
        (`densekit.models.dimensions.truncated`, as the encoder cuts them); the unweighted parts are
        kept in `self.parts` for the log (with Matryoshka, the parts summed with the widths' weights, and
        each width's loss as `loss_<width>d`). With `score_alignment`, each narrower width's loss also
        takes that weight times the KL divergence from the widest width's in-batch scores to its own
        (`score_alignment_loss`). The distillation term needs only each query's own group, which is on
        its own process, so it is never gathered."""
        matryoshka = self.config.loss.matryoshka
        if matryoshka is None:
            total, self.parts = self._terms(queries, passages, batch)
            return scale * total
        if queries.dtype in (torch.float16, torch.bfloat16):
            queries, passages = queries.float(), passages.float()
        normalize = self.encoder.config.normalize
        total = torch.zeros((), device=queries.device)
        parts: dict[str, Figure] = {}
        widest: torch.Tensor | None = None
        for width, weight in matryoshka.weighted():
            cut = [truncated(vectors, width, normalize) for vectors in (queries, passages)]
            loss, terms = self._terms(cut[0], cut[1], batch)
            if matryoshka.score_alignment > 0:
                scores = self._in_batch_scores(cut[0], cut[1])
                if widest is None:
                    widest = scores
                else:
                    aligned = score_alignment_loss(scores, widest, batch.false_negatives)
                    terms["loss_alignment"] = device_figure(aligned)
                    loss = loss + matryoshka.score_alignment * self._gathered_weight() * aligned
            total = total + weight * loss
            for name, value in terms.items():
                parts[name] = parts.get(name, 0.0) + weight * value
            parts[f"loss_{width}d"] = self._combined(terms)
        self.parts = parts
        return scale * total

    def _terms(
        self, queries: torch.Tensor, passages: torch.Tensor, batch: ContrastiveBatch
    ) -> tuple[torch.Tensor, dict[str, Figure]]:
        """The weighted sum of InfoNCE and the distillation term on these vectors, and each term
        unweighted, by its name in the log."""
        config = self.config.loss
        total = torch.zeros((), device=queries.device)
        parts: dict[str, Figure] = {}
        if config.contrastive_weight > 0:
            contrastive = contrastive_loss(
                queries, passages, self.config.data.group_size, self.temperature,
                config.cross_device_negatives, batch.false_negatives, batch.positives,
            )  # fmt: skip
            parts["loss_contrastive"] = device_figure(contrastive) / self._gathered_weight()
            total = total + config.contrastive_weight * contrastive
        if batch.teacher is not None:
            student = group_scores(queries, passages, self.config.data.group_size)
            teacher = batch.teacher.to(student.device)
            if config.distillation == "margin_mse":
                distilled = margin_mse_loss(student, teacher)
            else:
                distilled = kl_distillation_loss(
                    student, teacher, self.temperature, config.teacher_temperature
                )
            parts["loss_distillation"] = device_figure(distilled)
            total = total + config.distillation_weight * distilled
        return total, parts

    def _in_batch_scores(self, queries: torch.Tensor, passages: torch.Tensor) -> torch.Tensor:
        """Every query's scores against every passage of the batch (gathered from every process under
        `loss.cross_device_negatives`), divided by the temperature, as InfoNCE sees them."""
        if self.config.loss.cross_device_negatives:
            queries, passages = distributed.gather_with_grad(queries), distributed.gather_with_grad(passages)
        return queries @ passages.T / self.temperature

    def _gathered_weight(self) -> int:
        """What a loss over the gathered batch is multiplied by before its backward pass (1 without
        `loss.cross_device_negatives`)."""
        return distributed.gathered_loss_weight() if self.config.loss.cross_device_negatives else 1

    def _combined(self, parts: dict[str, Figure]) -> Figure:
        """The loss that `parts` (InfoNCE, distillation and score alignment, unweighted) make with the
        run's weights."""
        config = self.config.loss
        alignment = config.matryoshka.score_alignment if config.matryoshka is not None else 0.0
        return (config.contrastive_weight * parts.get("loss_contrastive", 0.0)
                + config.distillation_weight * parts.get("loss_distillation", 0.0)
                + alignment * parts.get("loss_alignment", 0.0))  # fmt: skip

    def forward_backward(self, batch: ContrastiveBatch, scale: float = 1.0) -> dict[str, Figure]:
        """Compute the loss of `batch` times `scale` and back-propagate it; returns the unscaled loss."""
        batch = batch.to(self.encoder.device)
        encode_queries, encode_passages = self._encode("query", batch.domain), self._encode("passage")
        cache = self.config.grad_cache
        if cache.enabled:
            loss, _ = cached_backward(
                [
                    (encode_queries, split_inputs(batch.queries, cache.chunk_size)),
                    (encode_passages, split_inputs(batch.passages, cache.chunk_size)),
                ],
                lambda q, p: self._loss(q, p, scale, batch),
                self.encoder.device,
            )
        else:
            queries = encode_queries(batch.queries)[0]
            loss = self._loss(queries, encode_passages(batch.passages)[0], scale, batch)
            loss.backward()
        routing = self._route_balance(batch, scale) if self.route is not None else {}
        if set(self.parts) == {"loss_contrastive"} and not routing:
            return {"loss": self.parts["loss_contrastive"]}
        total = self._combined(self.parts)
        total += self.config.route.load_balancing * routing.get("loss_balance", 0.0) if routing else 0.0
        return {"loss": total, **self.parts, **routing}

    def _route_balance(self, batch: ContrastiveBatch, scale: float) -> dict[str, float]:
        """Back-propagate the load-balancing term of the batch's routing (it needs the router's scores of
        the whole batch, so it is computed apart from the cached loss; a fusion has none); returns it and
        the routing's mean entropy."""
        device = self.encoder.device
        queries = {key: tensor.to(device) for key, tensor in batch.queries.items()}
        figures = {}
        weights, balance = self.route.strategy.training_weights(
            self.route, queries["input_ids"], queries["attention_mask"]
        )
        if balance is not None:
            weight = self.config.route.load_balancing
            if weight > 0:
                (scale * weight * balance).backward()
            figures["loss_balance"] = float(balance.detach())
        entropy = -(weights * weights.clamp_min(1e-12).log()).sum(-1).mean()
        return {**figures, "route_entropy": float(entropy.detach())}

    def export(self, path: Path) -> None:
        """Save the trained encoder as a model folder, or the trained route as a route folder."""
        if self.route is not None:
            self.route.save(path, self.module_folders)
        elif self.hypernetwork is not None:
            self.hypernetwork.save(path)
        else:
            self.encoder.save(path)


def _check_teacher_scores(examples: list[TrainingExample], config: TrainConfig) -> None:
    """Before training: every positive and negative of every example has a teacher score, and no
    group is filled with corpus documents (which have none)."""
    for line, example in enumerate(examples, start=1):
        scores = example.teacher_scores or {}
        missing = [doc for doc in (*example.positives, *example.negatives) if doc not in scores]
        if missing:
            raise InputError(
                f"{config.data.train}:{line}: query {example.query_id!r} has no teacher score for document "
                f"{missing[0]!r}; distillation needs one for every positive and negative"
            )
        if len(example.negatives) < config.data.group_size - 1 and config.data.shortfall == "random":
            raise InputError(
                f"{config.data.train}:{line}: query {example.query_id!r} is filled with random corpus "
                "documents (data.shortfall random), which have no teacher scores: use 'repeat' or a "
                "smaller group"
            )


def _teacher_scores(example: TrainingExample, documents: list[str]) -> list[float]:
    """The teacher's scores of `documents` for `example`; every one must be there."""
    scores = example.teacher_scores or {}
    missing = [doc for doc in documents if doc not in scores]
    if missing:
        raise InputError(
            f"query {example.query_id!r} has no teacher score for document {missing[0]!r}: distillation "
            "needs teacher_scores for every positive and negative of the training examples"
        )
    return [scores[doc] for doc in documents]
