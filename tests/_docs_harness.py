"""Find and run the code examples of README.md, docs/**/*.md and the docstrings of the knitdata package.

What runs (``tests/test_docs.py``):

* **Markdown** (``README.md``, ``docs/**/*.md``): every fenced ```` ```python ```` block. An HTML comment on the
  line right before the fence (blank lines allowed) says how:

  - ``<!-- docs-test: skip REASON -->``: not run here; ``REASON`` (required) says why and what runs it instead;
  - ``<!-- docs-test: continue -->``: runs in the namespace the previous block of the same file left;
  - ``<!-- docs-test: setup NAME -->``: runs in a fresh namespace holding the placeholders of ``SETUPS[NAME]``.

  Without a marker a block runs in a fresh namespace with the ``default`` placeholders.
* **Docstrings** (every module of the package, its classes, functions and methods): every ``>>>`` doctest, every
  ```` ```python ```` fence, and every literal block (a paragraph ending in ``::``) whose introducing paragraph
  starts with ``Example`` or ``Recipe``; other literal blocks (a record layout, a ``tar tf`` listing) are not
  code. They run in a copy of the module's namespace plus the placeholders ``DOCSTRING_SETUPS`` names for that
  docstring.

Placeholders. The docs use a few names that stand for the reader's own code (``my_rollout_engine()``,
``model``, ``loss_sum``...). A setup defines each of them as the smallest real thing that fits (a generator of
valid trajectories for the block's ``spec``, a tiny ``torch`` model, a filled pipeline); nothing knitdata does is
replaced. The exceptions, named where they are defined: ``DDP`` and ``fully_shard`` in the ``knitdata.media.encoder``
examples are plain (single-process) wrappers; ``tests/test_encoder_distributed.py`` runs those patterns across
gloo ranks.

Every block runs in a temporary working directory; an exception raised in a thread the block started fails the
block too.
"""

from __future__ import annotations

import contextlib
import doctest
import importlib
import io
import logging
import os
import pkgutil
import re
import textwrap
import threading
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"^<!--\s*docs-test:\s*(skip|continue|setup)\b\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)```python\s*$")


# ================================================================================================ extraction
@dataclass
class Block:
    """One code example: where it is, its code, and how to run it."""

    where: str  # "README.md:42" or "knitdata.media.encoder (module):3"
    code: str
    mode: str = "run"  # "run", "skip", "continue" or "doctest"
    setup: str = "default"
    reason: str = ""
    doctest: doctest.DocTest | None = field(default=None, repr=False)

    @property
    def id(self) -> str:
        return self.where


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def markdown_blocks(path: Path) -> list[Block]:
    """The ```python blocks of a markdown file, with the marker before each (see the module docstring)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    rel = path.relative_to(ROOT).as_posix()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent = len(m.group(1))
        j = i + 1
        body = []
        while j < len(lines) and lines[j].strip() != "```":
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
            j += 1
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker = MARKER.match(lines[k].strip()) if k >= 0 else None
        block = Block(f"{rel}:{i + 1}", "\n".join(body) + "\n")
        if marker:
            kind, arg = marker.group(1), marker.group(2)
            if kind == "skip":
                if not arg:
                    raise AssertionError(f"{block.where}: '<!-- docs-test: skip -->' needs a reason")
                block.mode, block.reason = "skip", arg
            elif kind == "continue":
                block.mode = "continue"
            else:
                block.setup = arg
        elif k >= 0 and "docs-test" in lines[k]:
            raise AssertionError(f"{block.where}: malformed marker {lines[k].strip()!r}")
        out.append(block)
        i = j + 1
    return out


def knitdata_module_names() -> list[str]:
    """Every module of the package (``__main__`` excluded: importing it runs the command line), not imported."""
    import knitdata

    names = ["knitdata"] + [m.name for m in pkgutil.walk_packages(knitdata.__path__, "knitdata.")]
    return sorted(n for n in names if not n.endswith("__main__"))


def knitdata_modules() -> list[Any]:
    return [importlib.import_module(n) for n in knitdata_module_names()]


_LITERAL_INTRO = re.compile(r"^(Example|Recipe)\b")


def _literal_blocks(doc: str) -> Iterator[tuple[int, str]]:
    """``(line, code)`` of the literal blocks of a docstring introduced by an ``Example``/``Recipe`` paragraph."""
    lines = doc.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].rstrip().endswith("::") and not lines[i].strip().startswith(">>>"):
            start = i
            while start > 0 and lines[start - 1].strip():
                start -= 1
            intro = lines[start].strip()
            j = i + 1
            while j < len(lines) and not lines[j].strip():
                j += 1
            base = len(lines[i]) - len(lines[i].lstrip())
            body = []
            while j < len(lines) and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > base):
                body.append(lines[j])
                j += 1
            if _LITERAL_INTRO.match(intro):
                yield i + 1, textwrap.dedent("\n".join(body)).strip("\n") + "\n"
            i = j
        else:
            i += 1


def _fenced_blocks(doc: str) -> Iterator[tuple[int, str]]:
    lines = doc.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            j = i + 1
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            yield i + 1, textwrap.dedent("\n".join(lines[i + 1 : j])) + "\n"
            i = j + 1
        else:
            i += 1


def docstring_blocks(module: Any) -> list[Block]:
    """Every docstring example of one module (its own docstring, its classes', functions' and methods'):
    doctests, ```python fences, ``Example::`` literal blocks."""
    finder = doctest.DocTestFinder(exclude_empty=False)
    parser = doctest.DocTestParser()
    out: list[Block] = []
    for test in finder.find(module, module.__name__, globs={}):  # objects defined in this module only
        doc = test.docstring or ""
        if test.examples:
            out.append(Block(f"{test.name}:doctest", "", mode="doctest",
                             doctest=parser.get_doctest(doc, {}, test.name, test.filename, test.lineno)))
        for line, code in [*_fenced_blocks(doc), *_literal_blocks(doc)]:
            out.append(Block(f"{test.name}:{line}", code))
    return out


def example_headers_without_code() -> list[str]:
    """Docstrings with an ``Example`` heading but no runnable example found (a format the harness cannot see)."""
    finder = doctest.DocTestFinder(exclude_empty=False)
    bad = []
    for module in knitdata_modules():
        for test in finder.find(module, module.__name__, globs={}):
            doc = test.docstring or ""
            heads = [ln for ln in doc.splitlines() if re.match(r"^\s*Examples?\b.*:\s*$", ln)]
            if heads and not (test.examples or list(_fenced_blocks(doc)) or list(_literal_blocks(doc))):
                bad.append(f"{test.name}: {heads[0].strip()!r}")
    return sorted(set(bad))


# ================================================================================================ placeholders
VOCAB = 32


class TinyLM(torch.nn.Module):
    """``model``: an embedding and a head; ``no_sync()`` like a DDP-wrapped model (a no-op in one process)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 8)
        self.head = torch.nn.Linear(8, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids))

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield


def loss_sum(model: torch.nn.Module, mb: Any) -> torch.Tensor:
    """``loss_sum(model, mb)``: next-token negative log-likelihood summed over the loss tokens (0 when empty,
    still connected to the graph, as the docs ask of an empty micro-batch)."""
    if mb.is_empty:
        return sum(p.sum() for p in model.parameters()) * 0.0
    logits = model(mb.input_ids)[:, :-1]
    logp = torch.log_softmax(logits, -1).gather(-1, mb.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return -(logp * mb.loss_mask[:, 1:]).sum()


def trajectories(spec: Any, train_batches: int = 1, *, image: bool = False, seed: int = 0) -> list[Any]:
    """``my_rollout_engine()`` / ``rollout()``: whole groups filling ``train_batches`` train batches of ``spec``,
    2-8 prompt and 2-8 response tokens each (every group's members share an image with ``image=True``)."""
    from knitdata import Trajectory, image_item

    out = []
    for b in range(train_batches):
        for s in spec.sources:
            for g in range(spec.quotas[s] // spec.group_size):
                group = f"b{b}-{s}-g{g}"
                gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{group}".encode()))
                prompt = torch.randint(1, VOCAB, (int(torch.randint(2, 9, (1,), generator=gen)),), generator=gen)
                media = []
                if image:
                    media = [image_item(torch.randint(0, 256, (3, 28, 28), generator=gen, dtype=torch.uint8))]
                for r in range(spec.group_size):
                    resp = torch.randint(1, VOCAB, (int(torch.randint(2, 9, (1,), generator=gen)),), generator=gen)
                    out.append(Trajectory(id=f"{group}-r{r}", source=s, group=group, prompt_ids=prompt.clone(),
                                          response_ids=resp, gen_version=b * spec.num_minibatches, media=media,
                                          scalars={"reward": float(r % 2)}))
    return out


def _spec() -> Any:
    from knitdata import BatchSpec

    return BatchSpec({"math": 4, "code": 4}, num_minibatches=2, group_size=2)


def _filled(spec: Any, num_consumers: int = 1, *, image: bool = False) -> Any:
    from knitdata import Pipeline

    pipe = Pipeline(spec, num_consumers=num_consumers, token_budget=64)
    for t in trajectories(spec, image=image):
        pipe.put(t)
    pipe.close()
    return pipe


def setup_default(ns: dict[str, Any]) -> None:
    """The producer-side placeholders, and a model: an open empty pipeline ``pipe`` (= ``pipeline``, one
    consumer) for ``spec``; ``my_rollout_engine()`` and ``rollout()`` yield one train batch of the ``spec`` the
    block's namespace holds when they are called; ``log``; ``rank`` 0 of ``world`` 1; ``model`` (``TinyLM``),
    ``my_model()``, ``opt`` = ``optimizer`` (SGD), ``loss_sum(model, mb)`` = ``my_loss_sum(model, mb)``."""
    from knitdata import Pipeline

    spec = _spec()
    pipe = Pipeline(spec, num_consumers=1, token_budget=64)
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def rollout() -> Iterator[Any]:
        yield from trajectories(ns.get("spec", spec))

    ns.update(spec=spec, pipe=pipe, pipeline=pipe, my_rollout_engine=rollout, rollout=rollout,
              log=logging.getLogger("knitdata.docs"), rank=0, world=1, model=model, my_model=TinyLM, opt=opt,
              optimizer=opt, loss_sum=loss_sum, my_loss_sum=loss_sum)


def setup_consumer(ns: dict[str, Any]) -> None:
    """``default``, with ``pipe`` (= ``pipeline``) filled with one train batch (2 mini-batches) and closed;
    ``ds = pipe.dataset(rank)``; checkpoints: ``want_checkpoint`` (True), ``save_checkpoint(model, opt,
    loader_state=...)`` keeps the last one, ``load_checkpoint()`` returns it."""
    setup_default(ns)
    pipe = _filled(ns["spec"])
    saved: dict[str, Any] = {}

    def save_checkpoint(model: Any, opt: Any, *, loader_state: dict[str, Any]) -> None:
        saved.update(model=model.state_dict(), opt=opt.state_dict(), loader_state=loader_state)

    ns.update(pipe=pipe, pipeline=pipe, ds=pipe.dataset(ns["rank"]), want_checkpoint=True,
              save_checkpoint=save_checkpoint, load_checkpoint=lambda: dict(saved))


def setup_resume(ns: dict[str, Any]) -> None:
    """A new job: ``spec``, ``rank`` 0 of ``world`` 1, ``saved_state`` (rank 0's state after the first mini-batch of
    an earlier identical pipeline), ``replay_same_puts(pipe)`` (the same puts, then ``close()``), and ``default``'s
    model placeholders."""
    setup_default(ns)
    spec = ns["spec"]
    first = _filled(spec)
    ds = first.dataset(0, fetch="sample")
    for mb in ds:
        if mb.info.is_last:
            break
    saved_state = ds.state_dict()
    ds.close()

    def replay_same_puts(pipe: Any) -> None:
        try:
            for t in trajectories(spec):
                pipe.put(t)
        finally:
            pipe.close()

    ns.update(saved_state=saved_state, replay_same_puts=replay_same_puts)


class TinyVLM(torch.nn.Module):
    """``model`` of the multimodal page: ``encoder`` (one row per 14x14 patch, ``encoder(values, offsets)``) and
    ``backbone(mb, per_occurrence_rows, sequence_of_each)`` returning a scalar loss."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = _PatchEncoder()
        self.emb = torch.nn.Embedding(VOCAB, 8)

    def backbone(self, mb: Any, per_occ: Any, seq_of: torch.Tensor) -> torch.Tensor:
        h = self.emb(mb.input_ids).sum(1)  # [B, 8]
        for rows, j in zip(per_occ, seq_of.tolist()):
            h = h.index_add(0, torch.tensor([j]), rows.sum(0, keepdim=True))
        return (h ** 2).sum() / 100


class _PatchEncoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(3 * 14 * 14, 8)

    def forward(self, values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(values))


def setup_multimodal(ns: dict[str, Any]) -> None:
    """``pipe`` (one consumer) filled with groups that share a 28x28 image; ``model`` (``TinyVLM``), ``opt``,
    ``scale`` (1.0), ``rank`` 0."""
    spec = _spec()
    pipe = _filled(spec, image=True)
    model = TinyVLM()
    ns.update(spec=spec, pipe=pipe, pipeline=pipe, model=model, opt=torch.optim.SGD(model.parameters(), lr=0.1),
              scale=1.0, rank=0, world=1)


def setup_qwen(ns: dict[str, Any]) -> None:
    """``model``: a tiny random-init Qwen2.5-VL (``tests/_hf_helpers.py``, float32, nothing downloaded); ``pipe``
    (one consumer) filled with 2 groups of 4 responses sharing a 32x32 image, one image placeholder per prompt,
    2 micro-batches per mini-batch; ``rank`` 0 of ``world`` 1; ``opt``."""
    import numpy as np
    from _hf_helpers import IMAGE_ID, VEND, VSTART, tiny_qwen2_5_vl

    from knitdata import BatchSpec, Pipeline, Trajectory, image_item

    model = tiny_qwen2_5_vl(dtype=torch.float32)
    spec = BatchSpec({"vqa": 8}, num_minibatches=2, group_size=4)
    pipe = Pipeline(spec, num_consumers=1, token_budget=24)
    rng = np.random.default_rng(0)
    for g in range(2):
        image = image_item(rng.integers(0, 256, (3, 32, 32), dtype=np.uint8))
        for r in range(4):
            pipe.put(Trajectory(id=f"g{g}-r{r}", source="vqa", group=f"g{g}", media=[image],
                                prompt_ids=torch.tensor([1, VSTART, IMAGE_ID, VEND, 7, 8]),
                                response_ids=torch.from_numpy(rng.integers(3, 100, 5))))
    pipe.close()
    ns.update(model=model, spec=spec, pipe=pipe, pipeline=pipe, rank=0, world=1,
              opt=torch.optim.AdamW(model.parameters(), lr=1e-4))


def setup_omni(ns: dict[str, Any]) -> None:
    """``model``: a tiny random-init Qwen2.5-Omni thinker (``tests/_hf_helpers.py``, float32), its
    ``image_processor`` and ``feature_extractor``; ``mp4``: a small MP4 container; ``pipe`` (one consumer) filled
    with 2 groups of 4 responses sharing an image, a video and an audio clip; ``rank`` 0 of ``world`` 1; ``opt``."""
    import _hf_helpers as hf
    import numpy as np

    from knitdata import BatchSpec, Pipeline, Trajectory, audio_item, image_item, video_item

    model = hf.tiny_qwen2_5_omni(dtype=torch.float32)
    model.model.audio_tower.audio_bos_eos_token.requires_grad_(False)
    spec = BatchSpec({"av": 8}, num_minibatches=2, group_size=4)
    pipe = Pipeline(spec, num_consumers=1, token_budget=40)
    rng = np.random.default_rng(0)
    prompt = torch.tensor([1, hf.VSTART, hf.IMAGE_ID, hf.VEND, hf.VSTART, hf.VIDEO_ID, hf.VEND, hf.ASTART,
                           hf.AUDIO_ID, hf.AEND, 7])
    for g in range(2):
        media = [image_item(rng.integers(0, 256, (3, 32, 32), dtype=np.uint8)), video_item(hf.tiny_video(seed=g)),
                 audio_item(rng.standard_normal(4000).astype(np.float32), sample_rate=16000)]
        for r in range(4):
            pipe.put(Trajectory(id=f"g{g}-r{r}", source="av", group=f"g{g}", media=media, prompt_ids=prompt,
                                response_ids=torch.from_numpy(rng.integers(3, 100, 5))))
    pipe.close()
    ns.update(model=model, spec=spec, pipe=pipe, pipeline=pipe, rank=0, world=1, mp4=hf.tiny_video(seed=5),
              image_processor=hf.tiny_image_processor(), feature_extractor=hf.tiny_feature_extractor(),
              opt=torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4))


SETUPS: dict[str, Callable[[dict[str, Any]], None]] = {
    "default": setup_default,
    "omni": setup_omni,
    "consumer": setup_consumer,
    "resume": setup_resume,
    "multimodal": setup_multimodal,
    "qwen": setup_qwen,
}


# ------------------------------------------------------------------------------------------------ docstrings
def _micro_batches(spec: Any = None) -> list[list[Any]]:
    """Two micro-batches of one mini-batch: group g0 (sharing an image) split over both, g1 in the second."""
    from knitdata import BatchSpec

    ts = trajectories(spec or BatchSpec({"vqa": 4}, num_minibatches=1, group_size=2), image=True)
    return [ts[0:2], ts[2:4]]


def doc_multimodal(ns: dict[str, Any]) -> None:
    """``micro_batch_0``, ``micro_batch_1``: lists of trajectories; 2 images, the first one in both."""
    ns["micro_batch_0"], ns["micro_batch_1"] = _micro_batches()
    ns["micro_batch_1"] = ns["micro_batch_1"][:1] + ns["micro_batch_0"][:1]


def doc_storage_unit(ns: dict[str, Any]) -> None:
    """``traj``: one trajectory."""
    ns["traj"] = trajectories(_spec())[0]


def doc_accelerate(ns: dict[str, Any]) -> None:
    """``model``, ``opt``, ``per_token_loss(model, mb)`` and a filled one-consumer ``pipeline``."""
    setup_consumer(ns)

    def per_token_loss(model: Any, mb: Any) -> torch.Tensor:
        logits = model(mb.input_ids)
        return -torch.log_softmax(logits, -1).gather(-1, mb.input_ids.unsqueeze(-1)).squeeze(-1)

    ns["per_token_loss"] = per_token_loss


class _PlainWrapper(torch.nn.Module):
    """``DDP`` in the ``knitdata.media.encoder`` examples: wraps the model as ``.module`` (one process, no reduction)."""

    def __init__(self, module: torch.nn.Module, **_: Any) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


class _VisionLanguageModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = _PatchEncoder()
        self.backbone = torch.nn.Embedding(VOCAB, 8)

    def forward(self, input_ids: torch.Tensor, rows: torch.Tensor | None, occ: Any) -> torch.Tensor:
        h = self.backbone(input_ids).sum()
        return h if rows is None else h + rows.sum()


def doc_encoder(ns: dict[str, Any]) -> None:
    """``DDP`` (a plain wrapper), ``VisionLanguageModel``, ``fully_shard`` (a no-op), ``encoder``, ``backbone``,
    ``dummy``, ``mm_batch`` with ``micro_batches`` / ``tokens`` / ``K``, ``scale``, ``optimizer``."""
    from knitdata import MultimodalCollator, TokenCollator, patchify

    groups = _micro_batches()
    mm = MultimodalCollator({"image": patchify(14)})(groups)
    collate = TokenCollator()
    vlm = _VisionLanguageModel()

    def backbone(tokens: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        h = vlm.backbone(tokens).sum()
        return h if rows is None else h + rows.sum()

    ns.update(DDP=_PlainWrapper, VisionLanguageModel=_VisionLanguageModel, fully_shard=lambda m: m,
              encoder=vlm.encoder, backbone=backbone, dummy=None, mm_batch=mm,
              micro_batches=[collate(g) for g in groups], tokens=[collate(g).input_ids for g in groups], K=len(groups),
              scale=[1.0, 0.5], optimizer=torch.optim.SGD(vlm.parameters(), lr=0.1))


def doc_llava(ns: dict[str, Any]) -> None:
    """The LLaVA recipe: ``model`` (a tiny random-init ``LlavaForConditionalGeneration``: CLIP tower of 16x16
    images in 4x4 patches, one Llama layer; nothing downloaded), its ``image_processor`` (a
    ``CLIPImageProcessor`` built for 16x16), ``micro_batches`` (two, whose prompts hold one image token)."""
    ns.update(tiny_llava())


def tiny_llava(seed: int = 0, dtype: torch.dtype = torch.float64) -> dict[str, Any]:
    from transformers import CLIPImageProcessor, CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    from knitdata import BatchSpec

    torch.manual_seed(seed)
    vc = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                          image_size=16, patch_size=4, projection_dim=16)
    cfg = LlavaConfig(vision_config=vc, image_token_id=31,
                      text_config=dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                       pad_token_id=0, bos_token_id=1, eos_token_id=2))
    model = LlavaForConditionalGeneration(cfg).to(dtype)
    processor = CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    mbs = _micro_batches(BatchSpec({"vqa": 4}, num_minibatches=1, group_size=2))
    for mb in mbs:  # one image token at the end of each prompt, token ids below 31 everywhere else
        for t in mb:
            t.prompt_ids = torch.cat([t.prompt_ids.clamp(max=30), torch.tensor([31])])
            t.response_ids = t.response_ids.clamp(max=30)
    return {"model": model, "image_processor": processor, "micro_batches": mbs}


#: Placeholders per docstring (its name as doctest reports it: ``module``, ``module.Class``, ...).
DOCSTRING_SETUPS: dict[str, Callable[[dict[str, Any]], None]] = {
    "knitdata.media.multimodal": doc_multimodal,
    "knitdata.engines.embedded.unit.EmbeddedStorageUnit": doc_storage_unit,
    "knitdata.integrations.accelerate": doc_accelerate,
    "knitdata.media.encoder": doc_encoder,
}
#: Placeholders of one block of a docstring, by the first line of its code.
BLOCK_SETUPS: dict[str, Callable[[dict[str, Any]], None]] = {
    "from torch.nn.utils.rnn import pad_sequence": doc_llava,
}


# ================================================================================================ running
@contextlib.contextmanager
def _thread_errors() -> Iterator[list[BaseException]]:
    """Collect exceptions raised in threads started meanwhile (a consumer thread of an example that fails)."""
    errors: list[BaseException] = []
    old = threading.excepthook

    def hook(args: Any) -> None:
        errors.append(args.exc_value)
        old(args)

    threading.excepthook = hook
    try:
        yield errors
    finally:
        threading.excepthook = old


def _reset_accelerate() -> None:
    try:
        from accelerate.state import AcceleratorState, GradientState, PartialState
    except ImportError:  # pragma: no cover
        return
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def run_code(code: str, ns: dict[str, Any], where: str, workdir: Path) -> str:
    """Execute one block in ``ns`` with ``workdir`` as the working directory; return what it printed."""
    out = io.StringIO()
    old = os.getcwd()
    before = set(threading.enumerate())
    os.chdir(workdir)
    try:
        with _thread_errors() as errors, contextlib.redirect_stdout(out):
            exec(compile(code, where, "exec"), ns)
            for t in set(threading.enumerate()) - before:  # threads the block started and did not join
                if not t.daemon:
                    t.join(60)
                    assert not t.is_alive(), f"{where}: thread {t.name} still runs 60 s after the block ended"
        if errors:
            raise AssertionError(f"{where}: a thread raised {errors[0]!r}") from errors[0]
    finally:
        os.chdir(old)
        if "accelerate" in code:
            _reset_accelerate()
    return out.getvalue()


def run_markdown(path: Path, workdir: Path) -> list[str]:
    """Run every block of a markdown file in order; return the skipped ones with their reasons."""
    skipped = []
    ns: dict[str, Any] | None = None
    for block in markdown_blocks(path):
        if block.mode == "skip":
            skipped.append(f"{block.where}: {block.reason}")
            continue
        if block.mode == "continue":
            if ns is None:
                raise AssertionError(f"{block.where}: 'continue' without a block before it")
        else:
            if block.setup not in SETUPS:
                raise AssertionError(f"{block.where}: unknown setup {block.setup!r}; known: {sorted(SETUPS)}")
            ns = {"__name__": "__docs__"}
            SETUPS[block.setup](ns)
        run_code(block.code, ns, block.where, workdir)
    return skipped


def run_docstring_block(block: Block, workdir: Path) -> None:
    """Run one docstring example in a copy of its module's namespace plus its placeholders."""
    name = block.where.rsplit(":", 1)[0]
    module = importlib.import_module(_module_of(name))
    ns = dict(vars(module))
    setup = DOCSTRING_SETUPS.get(name)
    first = block.code.lstrip().split("\n", 1)[0].strip()
    setup = BLOCK_SETUPS.get(first, setup)
    if setup is not None:
        setup(ns)
    if block.mode == "doctest":
        assert block.doctest is not None
        block.doctest.globs = ns
        old = os.getcwd()
        os.chdir(workdir)
        try:
            runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
            report = io.StringIO()
            with _thread_errors() as errors:
                runner.run(block.doctest, out=report.write)
            result = runner.summarize(verbose=False)
        finally:
            os.chdir(old)
            _reset_accelerate()
        if result.failed:
            raise AssertionError(f"{block.where}: {result.failed} of {result.attempted} examples failed\n"
                                 f"{report.getvalue()[-4000:]}")
        if errors:
            raise AssertionError(f"{block.where}: a thread raised {errors[0]!r}") from errors[0]
        return
    run_code(block.code, ns, block.where, workdir)


def _module_of(name: str) -> str:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        return ".".join(parts[:i])
    raise ImportError(name)
