"""Offline TRL vision-language GRPO pieces: a Qwen2.5-VL processor with a hand-built tokenizer, a random-init
Qwen2.5-VL from a config, and an in-memory image dataset (nothing downloaded). Used by ``bench trl`` and the tests
of :mod:`knitdata.integrations.trl.vlm`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

__all__ = ["VLMShape", "CPU_SHAPE", "GPU_SHAPE", "TEST_SHAPE", "tiny_processor", "tiny_model", "image_dataset",
           "length_reward"]

SPECIAL = ["<pad>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>",
           "<|video_pad|>", "<unk>"]
WORDS = ["user", "assistant", "describe", "count", "colour", "image"] + [f"w{i}" for i in range(50)]
#: A chat template rendering an image part as Qwen's <|vision_start|><|image_pad|><|vision_end|>.
TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %} {{ c['text'] }}{% endif %}{% endfor %}{% endif %} <|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


@dataclass(frozen=True)
class VLMShape:
    """A Qwen2.5-VL configuration (vision tower and language model) and its image processor's patch geometry."""

    vision_depth: int
    vision_hidden: int
    vision_heads: int
    text_hidden: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    patch: int = 14
    merge: int = 2
    window: int = 112
    fullatt: tuple[int, ...] = field(default_factory=tuple)

    @property
    def mrope(self) -> tuple[int, int, int]:
        """M-RoPE sections (temporal, height, width) over half a text head, split as Qwen2.5-VL's 16/24/24."""
        half = self.text_hidden // self.text_heads // 2
        t = half // 4
        return (t, (half - t) // 2, half - t - (half - t) // 2)

    def as_dict(self) -> dict[str, Any]:
        """The shape as JSON-friendly values."""
        d = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}
        return {**d, "mrope": list(self.mrope)}


#: The CPU benchmark's model: Qwen2.5-VL-3B's proportions (vision 1280 wide x 32 blocks, text 2048 x 36) scaled
#: down, so that the tower's share of a row's FLOPs (38% at 224 px, 46% at 448 px) stays close to the real model's.
CPU_SHAPE = VLMShape(vision_depth=4, vision_hidden=128, vision_heads=4, text_hidden=256, text_layers=4, text_heads=4,
                     text_kv_heads=2, fullatt=(1, 3))
#: A real-size shape for a GPU (Qwen2.5-VL-3B's vision tower and language model widths and depths).
GPU_SHAPE = VLMShape(vision_depth=32, vision_hidden=1280, vision_heads=16, text_hidden=2048, text_layers=36,
                     text_heads=16, text_kv_heads=2, fullatt=(7, 15, 23, 31))
#: The tests' model: tiny.
TEST_SHAPE = VLMShape(vision_depth=2, vision_hidden=32, vision_heads=2, text_hidden=32, text_layers=1, text_heads=4,
                      text_kv_heads=2, patch=4, window=16, fullatt=(1,))


def tiny_processor(shape: VLMShape = TEST_SHAPE, max_pixels: int = 64 * 64) -> Any:
    """A ``Qwen2_5_VLProcessor`` with a hand-built word-level tokenizer and a Qwen2-VL image processor.

    The processor keeps only its image processor and tokenizer (no video processor: that one needs
    torchvision); it pads on the left, as TRL loads processors (prompts with images of different sizes have
    different lengths, and TRL left-pads its prompt ids). Images are resized to at most ``max_pixels`` pixels (multiples of ``patch * merge``).
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    class _ImageTextProcessor(Qwen2_5_VLProcessor):
        @classmethod
        def get_attributes(cls) -> list[str]:
            return ["image_processor", "tokenizer"]

    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>", unk_token="<unk>",
                                   additional_special_tokens=SPECIAL[1:7])
    fast.chat_template = TEMPLATE
    fast.padding_side = fast.truncation_side = "left"  # what TRL asks of the processors it loads itself
    unit = shape.patch * shape.merge
    images = Qwen2VLImageProcessorPil(
        patch_size=shape.patch, temporal_patch_size=2, merge_size=shape.merge,
        size={"shortest_edge": unit * unit, "longest_edge": max(max_pixels, unit * unit)},
    )
    return _ImageTextProcessor(image_processor=images, tokenizer=fast, chat_template=TEMPLATE)


def tiny_model(shape: VLMShape = TEST_SHAPE, seed: int = 0, dtype: torch.dtype = torch.float32) -> Any:
    """A random-init ``Qwen2_5_VLForConditionalGeneration`` of ``shape`` over :func:`tiny_processor`'s vocabulary."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {t: i for i, t in enumerate(SPECIAL + WORDS)}
    cfg = Qwen2_5_VLConfig(
        vision_config=dict(
            depth=shape.vision_depth, hidden_size=shape.vision_hidden, intermediate_size=2 * shape.vision_hidden,
            num_heads=shape.vision_heads, out_hidden_size=shape.text_hidden, patch_size=shape.patch,
            temporal_patch_size=2, spatial_merge_size=shape.merge, window_size=shape.window,
            fullatt_block_indexes=list(shape.fullatt), in_channels=3,
        ),
        text_config=dict(
            hidden_size=shape.text_hidden, intermediate_size=2 * shape.text_hidden, num_hidden_layers=shape.text_layers,
            num_attention_heads=shape.text_heads, num_key_value_heads=shape.text_kv_heads, vocab_size=len(ids),
            max_position_embeddings=8192, rope_scaling={"type": "mrope", "mrope_section": list(shape.mrope)},
            bos_token_id=ids["<|im_start|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<pad>"],
        ),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(seed)
    model: Any = Qwen2_5_VLForConditionalGeneration(cfg)
    return model.to(dtype)


def image_dataset(n: int, size: int | tuple[int, ...], seed: int = 0, sources: tuple[str, ...] = ("describe",)) -> Any:
    """``n`` conversational prompts, each with its own random square image (``datasets.Dataset``).

    Image sides cycle over ``size``; prompts cycle over ``sources`` (their first word; also a ``source`` column).
    """
    from datasets import Dataset
    from PIL import Image

    rng = np.random.default_rng(seed)
    sides = (size,) if isinstance(size, int) else size
    images = [Image.fromarray(rng.integers(0, 256, (sides[i % len(sides)],) * 2 + (3,), dtype=np.uint8))
              for i in range(n)]
    src = [sources[i % len(sources)] for i in range(n)]
    prompts = [[{"role": "user", "content": f"{s} w{i % 50}"}] for i, s in enumerate(src)]
    return Dataset.from_dict({"prompt": prompts, "image": images, "source": src})


def length_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """A reward that needs no model: the completion's length in characters."""
    return [float(len(str(c))) for c in completions]
