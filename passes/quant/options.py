"""What a conversion asks of 4-bit quantization: one frozen `QuantOptions`, built once from the
user's flags (`quant_options`) and handed unchanged from the CLI and the Python API through the
convert pipeline to the quantize pass (passes/quant/quantize.py).

    --quant q4                    QuantOptions()                 the defaults below
    --quant q8, --q-bits 8        bits=8                         8-bit blocks (min/max or a
                                                                 grid step, no calibration)
    --quant q6, --q-bits 6        bits=6                         6-bit blocks, the same rule
                                                                 (codes packed, passes/ops.py)
    --quant mixed                 mixed=True                     4, 6 or 8 bits per tensor under
                                                                 a mean of MIXED_BITS_BUDGET bits
                                                                 (q4_allocate.choose_bits)
    --quant mixed --bits-budget 7 mixed=True, bits_budget=7.0    ... under a mean of 7 bits
    --block-size 64               block_size=64                  every tensor in blocks of 64
    --bits-budget 4.45            bits_budget=4.45               32 or 64 per tensor under a mean
    --sym                         symmetric=True                 fixed zero point 8
    --no-quant-lm-head            lm_head=False                  the LM head stays float
    --quant-embeddings            embeddings=True                an untied table quantized too
    --quant-method minmax         method="minmax"                no error-minimizing search
    --calibration FILE            calibration="FILE"             error feedback on its activations
    --no-calibration              default_calibration=False      no built-in text: data-free
    (Python API only)             norm_importance=False          data-free without gamma^2 weights

The calibration text itself is read and tokenized by the converter
(converter/calibration_input.py); the pass receives its tokens beside these options.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from fuselm.passes.errors import PassesError
from fuselm.passes.quant.q4_math import METHODS, mixed_bits_per_weight

BLOCK_SIZES = (32, 64, 128)
BITS = (4, 6, 8)
QUANT_CHOICES = ("none", "q4", "q6", "q8", "mixed")
# `--quant mixed`: 4-bit blocks, or 6- or 8-bit blocks of 128/64/32, per tensor, chosen by
# measured error per added bit under this mean of bits per quantized weight (float16 scales, as
# `quant-report` counts; a float32 graph stores them in float32: +16/B). On SmolLM2-135M a
# float32 graph then holds ~6.1 bits per parameter, within llama.cpp's Q4_K_M (6.27 there), and
# a budget of 7 gains no PPL there; Gemma 3 270M, whose tied table is 63 % of its weights, needs
# 7.0 to put that table in 6-bit blocks (BENCHMARKS.md 'Quantization quality', 'Gemma 3 270M').
MIXED_BITS_BUDGET = 5.75
DEFAULT_BLOCK_SIZE = 32
DEFAULT_METHOD = "search"
# Every tensor in blocks of 32 unless --block-size / --bits-budget say otherwise. A budget of
# 4.45 bits (32 or 64 per tensor) saves 0.175 bits per weight and costs PPL: on SmolLM2-135M
# +14 % against +11 % at block 32 everywhere (BENCHMARKS.md 'Quantization quality').
BITS_BUDGET_RANGE = (4.3125, 4.625)  # every tensor in blocks of 64 .. every one in blocks of 32


def _check_bits(bits: int, bits_budget: float | None, calibration: str | None) -> None:
    if bits not in BITS:
        raise PassesError(f"--q-bits {bits} is not supported; valid values: "
                          f"{', '.join(map(str, BITS))}")
    if bits != 4 and bits_budget is not None:
        raise PassesError(f"--bits-budget is a 4-bit mean; drop it with --q-bits {bits}")
    if bits != 4 and calibration:
        raise PassesError(f"--calibration shapes 4-bit rounding; drop it with --q-bits {bits}")


def _check_values(block_size: int | None, bits_budget: float | None, method: str,
                  mixed: bool = False) -> None:
    lo, hi = BITS_BUDGET_RANGE
    if mixed:  # every tensor in 4-bit blocks of --block-size .. every one in 8-bit blocks of 32
        lo = mixed_bits_per_weight(4, block_size or DEFAULT_BLOCK_SIZE)
        hi = mixed_bits_per_weight(8, 32)
    if bits_budget is not None and not lo <= bits_budget <= hi:
        what = ("with --quant mixed (every tensor at 4 bits .. every one in 8-bit blocks of 32)"
                if mixed else "(every tensor in blocks of 64 .. of 32)")
        raise PassesError(
            f"--bits-budget {bits_budget} is out of range; give {lo} .. {hi} bits/weight "
            + what)
    if not mixed and block_size is not None and bits_budget is not None:
        # the budget picks 32 or 64 per tensor (q4_allocate): one size for all would be dropped
        raise PassesError("--block-size sets one block size for every tensor and --bits-budget "
                          "chooses 32 or 64 per tensor; give one of them")
    if block_size is not None and block_size not in BLOCK_SIZES:
        raise PassesError(
            f"--block-size {block_size} is not supported; valid values: "
            f"{', '.join(str(b) for b in BLOCK_SIZES)}"
        )
    if method not in METHODS:
        raise PassesError(
            f"--quant-method {method!r} is not supported; valid values: {', '.join(METHODS)}"
        )


@dataclass(frozen=True)
class QuantOptions:
    """4-bit block quantization as asked for (see the module's table); validated when made."""

    method: str = DEFAULT_METHOD
    block_size: int | None = None  # None: DEFAULT_BLOCK_SIZE, or per tensor under a budget
    bits_budget: float | None = None  # None: every tensor in blocks of `block_size` (mixed:
    # the mean the 4/6/8-bit choice fills; None: MIXED_BITS_BUDGET)
    symmetric: bool = False
    lm_head: bool = True
    embeddings: bool = False
    calibration: str | None = None  # a text file
    default_calibration: bool = True  # without `calibration`: the built-in text
    norm_importance: bool = True  # without calibration data: RMSNorm's gamma^2 as importance
    bits: int = 4
    mixed: bool = False  # 4, 6 or 8 bits per tensor under `mixed_budget`

    def __post_init__(self) -> None:
        _check_values(self.block_size, self.bits_budget, self.method, self.mixed)
        if self.calibration and not self.default_calibration:
            raise PassesError("--calibration and --no-calibration contradict; drop one")
        _check_bits(self.bits, self.bits_budget, self.calibration)
        if self.bits == 6 and self.embeddings:
            # an untied table is stored in its own [V, H] layout, blocks along axis 1, and
            # 6-bit codes pack four in three bytes along axis 0 only (quantize.py)
            raise PassesError("--quant-embeddings: 6-bit codes do not pack an untied table's "
                              "rows; use --quant q8 or drop --quant-embeddings")
        if self.mixed and self.bits != 4:
            raise PassesError("--quant mixed chooses 4, 6 or 8 bits per tensor itself; drop "
                              "--q-bits")

    @property
    def mixed_budget(self) -> float:
        """`--quant mixed`'s mean bits per quantized weight."""
        return self.bits_budget if self.bits_budget is not None else MIXED_BITS_BUDGET

    @property
    def calibrates(self) -> bool:
        """Whether a calibration text runs: 4-bit only (6- and 8-bit blocks take min/max)."""
        return self.bits == 4 and bool(self.calibration or self.default_calibration)

    def blocks(self) -> tuple[int, float | None]:
        """(block size, bits budget): the budget asked for (32 or 64 per tensor under it), else
        none (every tensor in blocks of `block_size`, 32 by default; with `mixed`, the 4-bit
        blocks' size, the budget being the 4/6/8-bit choice's)."""
        return self.block_size or DEFAULT_BLOCK_SIZE, None if self.mixed else self.bits_budget


def quant_options(
    quant: str | None = None,
    *,
    block_size: int | None = None,
    bits_budget: float | None = None,
    symmetric: bool = False,
    quant_lm_head: bool | None = None,
    quant_embeddings: bool = False,
    quant_method: str = DEFAULT_METHOD,
    calibration: str | None = None,
    default_calibration: bool = True,
    norm_importance: bool = True,
    q_bits: int | None = None,
) -> QuantOptions | None:
    """The options the user's flags ask for (the CLI's and the Python API's spellings); None
    means no quantization. `quant_lm_head=None` is the default: quantized with q4. `q_bits`
    (4, 6 or 8) asks for quantization by itself. Raises PassesError naming the flag and its valid
    values."""
    q = (quant or (f"q{q_bits}" if q_bits else "none")).lower()
    if q not in QUANT_CHOICES:
        raise PassesError(
            f"--quant {quant!r} is not supported; valid values: {', '.join(QUANT_CHOICES)}"
        )
    _check_values(block_size, bits_budget, quant_method, q == "mixed")
    if q == "none":
        if symmetric or quant_lm_head or quant_embeddings:
            raise PassesError("--sym/--quant-lm-head/--quant-embeddings need --quant q4")
        if calibration:
            raise PassesError("--calibration needs --quant q4")
        if quant_method != DEFAULT_METHOD or not default_calibration:
            raise PassesError("--quant-method/--no-calibration shape 4-bit rounding; they need "
                              "--quant q4")
        if q_bits:
            raise PassesError("--q-bits needs quantization; drop --quant none")
        if block_size is not None or bits_budget is not None:
            raise PassesError("--block-size/--bits-budget shape quantized blocks; they need "
                              "--quant q4, q6, q8 or mixed")
        return None
    bits = {"q6": 6, "q8": 8}.get(q, 4)
    if q_bits is not None and (q == "mixed" or q_bits != bits):
        raise PassesError(f"--quant {q} and --q-bits {q_bits} contradict; give one")
    _check_bits(bits, bits_budget, calibration)
    return QuantOptions(quant_method, block_size, bits_budget, symmetric,
                        quant_lm_head is not False, quant_embeddings, calibration,
                        default_calibration, norm_importance, bits, q == "mixed")


# What a checkpoint that comes quantized (a GGUF in export/gguf/blocks.py's EXACT_TYPES) is
# converted with when no quantization is asked for: its blocks kept as they are (the quantize
# pass's given blocks), and what has no exact form here (a float matrix beside the quantized
# ones) in 8-bit blocks, the nearest fuselm holds; its embedding table too.
SOURCE_DEFAULT = QuantOptions(bits=8, default_calibration=False, embeddings=True)

# The flag names `quant_options` takes (the Python API tells them from its other options).
FLAGS = tuple(inspect.signature(quant_options).parameters)
