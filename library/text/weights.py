"""``--weighted_captions``: the A1111-style attention syntax of captions, parsed and tokenised as sd-scripts does.

Reproduces ``TokenizeStrategy._get_weighted_input_ids`` of sd-scripts' ``library/strategy_base.py`` (SD 1.x/2.x):

* ``(text)`` multiplies the weight of ``text`` by 1.1, ``[text]`` by 1/1.1, ``(text:1.3)`` by 1.3; brackets nest
  and multiply, innermost first. An unclosed ``(`` or ``[`` applies to the rest of the caption (all unclosed
  round brackets first, then the square ones); a ``)`` or ``]`` with nothing open, and ``:`` not followed by a
  number and ``)``, are plain text. ``\\(``, ``\\)``, ``\\[``, ``\\]`` and ``\\\\`` are literal characters; any other
  backslash is dropped. Neighbouring pieces of equal weight are joined.
* Each piece is tokenised on its own (without BOS/EOS) and its tokens take its weight; the tokens are cut to the
  caption length (75 · chunks) and wrapped as ``BOS tokens EOS pad…`` with weight 1.0 for BOS, EOS and padding.

Weights are not renormalised: the encoder states are multiplied by them (``library/families/sd/text_encoding.py``). As
sd-scripts warns, ``--shuffle_caption`` and tag dropout split captions at commas, so a comma inside brackets can
separate a bracket from its text.
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING

from library.base.errors import UserError

if TYPE_CHECKING:
    from transformers import CLIPTokenizer

log = logging.getLogger(__name__)

ROUND_FACTOR = 1.1
SQUARE_FACTOR = 1 / 1.1
ESCAPABLE = "()[]\\"
SPECIAL = "\\()[]:"
_EXPLICIT_WEIGHT = re.compile(r":([+-]?[.\d]+)\)")


def parse_prompt_attention(text: str) -> list[tuple[str, float]]:
    """``text`` as (piece, weight) pairs, e.g. ``"a (b:1.5) c"`` -> ``[("a ", 1.0), ("b", 1.5), (" c", 1.0)]``."""
    pieces: list[list] = []
    open_round: list[int] = []
    open_square: list[int] = []

    def scale_from(start: int, factor: float) -> None:
        for piece in pieces[start:]:
            piece[1] *= factor

    i = 0
    while i < len(text):
        char = text[i]
        if char == "\\":
            escaped = text[i + 1:i + 2]
            literal = escaped if escaped and escaped in ESCAPABLE else ""
            pieces.append([literal, 1.0])
            i += 1 + len(literal)
        elif char == "(":
            open_round.append(len(pieces))
            i += 1
        elif char == "[":
            open_square.append(len(pieces))
            i += 1
        elif char == ":":
            match = _EXPLICIT_WEIGHT.match(text, i)
            if match is None:
                pieces.append([":", 1.0])
                i += 1
                continue
            if open_round:
                scale_from(open_round.pop(), _weight_value(match.group(1), text))
            else:
                pieces.append([match.group(0), 1.0])
            i = match.end()
        elif char == ")" and open_round:
            scale_from(open_round.pop(), ROUND_FACTOR)
            i += 1
        elif char == "]" and open_square:
            scale_from(open_square.pop(), SQUARE_FACTOR)
            i += 1
        elif char in ")]":
            pieces.append([char, 1.0])
            i += 1
        else:
            end = i
            while end < len(text) and text[end] not in SPECIAL:
                end += 1
            pieces.append([text[i:end], 1.0])
            i = end
    for start in open_round:
        scale_from(start, ROUND_FACTOR)
    for start in open_square:
        scale_from(start, SQUARE_FACTOR)
    joined: list[tuple[str, float]] = []
    for piece, weight in pieces or [["", 1.0]]:
        if joined and joined[-1][1] == weight:
            joined[-1] = (joined[-1][0] + piece, weight)
        else:
            joined.append((piece, weight))
    return joined


def _weight_value(number: str, text: str) -> float:
    try:
        return float(number)
    except ValueError:
        raise UserError(f'weighted caption "{text}": "{number}" is not a number; write weights like (word:1.2), '
                        "or escape a literal parenthesis as \\( \\)") from None


def weighted_token_ids(tokenizer: CLIPTokenizer, caption: str, length: int) -> tuple[list[int], list[float]]:
    """``length`` token ids ``BOS tokens EOS pad…`` of ``caption`` and the weight of each (1.0 outside the text)."""
    pieces = parse_prompt_attention(caption)
    encoded = tokenizer([piece for piece, _ in pieces]).input_ids
    ids: list[int] = []
    weights: list[float] = []
    for piece_ids, (_, weight) in zip(encoded, pieces, strict=True):
        tokens = piece_ids[1:-1]
        ids += tokens
        weights += [weight] * len(tokens)
    room = length - 2
    if len(ids) > room:
        log.warning("weighted caption cut to %d tokens (raise --max_token_length to keep more): %.60s...", room,
                    caption)
        ids, weights = ids[:room], weights[:room]
    padding = room - len(ids)
    return ([tokenizer.bos_token_id, *ids, tokenizer.eos_token_id] + [tokenizer.pad_token_id] * padding,
            [1.0, *weights, 1.0] + [1.0] * padding)
