"""Byte-level BPE tokenizers trained locally and deterministically (built-in or given text)."""
from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD_TOKEN = "<pad>"
# NOTE: order fixes the ids: bos=0, eos=1, im_start=2, im_end=3, pad=4.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, IM_START, IM_END, PAD_TOKEN)

# ChatML-like template. It starts with bos (like Llama 3), so a rendered prompt must be encoded
# with add_special_tokens=False; content may be a string or a list of {"type": "text"} parts.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is not none %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# NOTE: the GPT-4-style split that Qwen2 tokenizers use (digits one at a time), plus NFC.
# transformers 5 rebuilds the normalizer/pre-tokenizer of every qwen2-type checkpoint's tokenizer
# this way, so using it everywhere keeps raw `tokenizers` and AutoTokenizer encodings identical.
SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a
single step.
Once upon a time, in a small village by the sea, there lived an old fisherman and his daughter.
Every morning they rowed out past the lighthouse, cast their nets, and sang songs about the
weather.
One stormy evening the wind howled, the waves crashed against the rocks, and the lamp went dark.
"We must light it again," said the daughter, climbing the spiral stairs with a lantern in her hand.
By dawn the storm had passed; the ships were safe, and the whole village came out to thank them.
Peregrine falcons are the fastest animals on Earth, diving at more than 300 kilometres per hour.
They nest on cliffs and tall buildings, and they hunt other birds in open flight over cities
and coasts.
Scientists measure the speed of light as 299,792,458 metres per second in a vacuum.
Water boils at 100 degrees Celsius at sea level, but at a lower temperature on a high mountain.
The mitochondria is often called the powerhouse of the cell, because it produces most of the
energy.
Photosynthesis turns sunlight, water and carbon dioxide into sugar and oxygen inside green leaves.
In 1969, two astronauts walked on the Moon while a third orbited above in the command module.
The history of computing runs from the abacus to mechanical calculators, vacuum tubes and
transistors.
Modern processors contain billions of transistors etched onto a thin slice of silicon.
A language model predicts the next token given the previous tokens, one step at a time.
The server receives a request, schedules it in a batch, runs the model, and streams the answer
back.
Memory is split into fixed-size blocks, so that many sequences can share the cache without waste.
To bake bread, mix flour, water, salt and yeast; knead the dough for ten minutes and let it rise.
Preheat the oven to 220 degrees, shape the loaf, and bake it for about forty minutes until golden.
For a simple soup, chop two onions, three carrots and a stick of celery, then simmer them in stock.
Add pepper, a bay leaf and a handful of fresh parsley; serve hot with a slice of warm bread.
Q: What is the capital of France? A: The capital of France is Paris.
Q: How many days are there in a leap year? A: There are 366 days in a leap year.
Q: Who wrote the play Hamlet? A: William Shakespeare wrote Hamlet around the year 1600.
Q: What is two plus two? A: Two plus two is four. Q: What is seven times eight? A: Fifty-six.
User: Can you help me plan a trip to the mountains next weekend?
Assistant: Of course! How many people are going, and do you prefer hiking, skiing or relaxing?
User: Just the two of us, and we love long walks through forests and along quiet rivers.
Assistant: Then pack good boots, a warm jacket, a map, water, snacks and a small first-aid kit.
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday are the days of the week.
January, February, March, April, May, June, July, August, September, October, November, December.
One, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve, twenty, hundred,
thousand.
Red, orange, yellow, green, blue, indigo and violet are the colours of the rainbow.
North, south, east and west; up and down; left and right; inside and outside; before and after.
def add(a, b):
    return a + b

for i in range(10):
    print(i, i * i)

class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()

if __name__ == "__main__":
    result = add(3, 4)
    print(f"result = {result}")
{"name": "peregrine", "version": "0.1.0", "tags": ["fast", "small", "local"], "count": 42}
SELECT id, name, email FROM users WHERE active = 1 ORDER BY name LIMIT 20;
https://example.com/docs/index.html?page=2&lang=en#section-3
The price rose from $12.50 to $14.75, an increase of 18%, while costs fell by 3.2% in the same
period.
Call 555-0123 between 9:00 and 17:30, or write to info@example.org before 31/12/2025.
Mathematics: 3 + 4 = 7, 10 - 6 = 4, 6 * 7 = 42, 81 / 9 = 9, and 2^10 = 1024; π ≈ 3.14159, e ≈
2.71828.
Temperatures ranged from −5 °C at night to 23 °C at noon; the wind blew at 40 km/h ± 5.
Le café est très chaud, et la crème brûlée est délicieuse. Où est la bibliothèque, s'il vous plaît?
Der Bär läuft über die Brücke, und die Kinder spielen fröhlich im Garten. Schöne Grüße aus München!
El niño comió una manzana en la mañana; ¿dónde está la estación? ¡Qué día tan bonito!
Ο ήλιος λάμπει και η θάλασσα είναι γαλάζια. Καλημέρα σε όλους!
Привет, как дела? Сегодня хорошая погода, и мы идём гулять в парк.
東京は日本の首都です。今日はいい天気ですね。我喜欢学习新的语言和读书。
한국어도 조금 배우고 있어요. 감사합니다!
Emoji are multi-byte too: 😀 🚀 🌍 ✨ 🎉 ❤️ 👍 and symbols like → ← ✓ ✗ € £ ¥ ©.
The library opened at nine o'clock. Students hurried in, found quiet corners, and opened their
books.
Some read novels about dragons and knights; others studied chemistry, economics or ancient history.
A cat slept on the windowsill, warm in the afternoon sun, ignoring the pigeons on the roof outside.
The gardener planted tulips, roses and sunflowers, then watered the vegetables: beans, peas
and tomatoes.
In the evening the market filled with voices, the smell of spices, and the colours of ripe fruit.
Trains left the station every twenty minutes, carrying workers, tourists and families to the coast.
The engineer checked the bridge for cracks, tested the cables, and wrote a careful report.
Good software is tested, documented, and simple enough that the next person can change it safely.
If the cache is full, the scheduler may preempt a request and recompute it later when memory
frees up.
Please summarize the following paragraph in one sentence, using clear and simple words.
Translate this sentence into French: "The weather is nice today, so we will eat outside."
Write a short poem about the ocean, the moon, and a small boat drifting home at night.
The moon rose slowly over the silver water, and the little boat drifted home on a gentle tide.
Rain fell softly on the roof; thunder rumbled far away; the candle flickered but did not go out.
Mountains, rivers, deserts, forests, islands, valleys, glaciers, volcanoes and wide green plains.
Elephants, giraffes, lions, zebras, penguins, dolphins, eagles, owls, wolves, foxes and bears.
Apples, bananas, cherries, grapes, lemons, mangoes, oranges, peaches, pears, plums and
strawberries.
Doctors, nurses, teachers, farmers, builders, pilots, painters, writers, musicians and programmers.
The committee postponed its decision, citing incomplete evidence and unexpected budgetary pressure.
Jupiter's moons include Io, Europa, Ganymede and Callisto; Saturn's rings glitter with frozen dust.
Her grandmother kept a notebook of remedies: ginger tea for colds, honey for coughs, rest for
everything.
Keyboard shortcuts: Ctrl+C copies, Ctrl+V pastes, Ctrl+Z undoes, and Alt+Tab switches windows.
Why did the chicken cross the road? Nobody knows, but the philosophers have written volumes
about it.
Quantum computers manipulate qubits, exploiting superposition and entanglement to explore
possibilities.
"""


def train_bpe_json(texts: Iterable[str], vocab_size: int, *, min_frequency: int = 1) -> str:
    """Train a byte-level BPE (bos/eos/im_start/im_end/pad first) on texts; its tokenizer.json."""
    from tokenizers import (Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers,
                            processors, trainers)

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} (bytes + special "
                         f"tokens), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    got = tok.get_vocab_size()
    if got != vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is not reachable on this corpus "
                         f"(training stopped at {got} tokens)")
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B:1",
            special_tokens=[(BOS_TOKEN, bos_id)]),
    ])
    return tok.to_str()


@functools.lru_cache(maxsize=8)
def _trained_tokenizer_json(vocab_size: int) -> str:
    return train_bpe_json(CORPUS.splitlines(keepends=True), vocab_size)


def token_texts(vocab_size: int) -> list[str]:
    """The decoded text of every token id of the built-in tokenizer of `vocab_size`."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(_trained_tokenizer_json(vocab_size))
    return [tok.decode([i], skip_special_tokens=False) for i in range(tok.get_vocab_size())]


def _write_portable_config(out: Path, tok: Any, model_max_length: int | None) -> None:
    # NOTE: transformers 5 writes chat_template.jinja, no special_tokens_map.json and a
    # tokenizer_class that 4.x does not know; rewrite them in the form both versions read.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    for key in ("extra_special_tokens", "backend"):
        cfg.pop(key, None)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    # NOTE: explicit null, else transformers 5's qwen2 tokenizer adds an <|endoftext|> unk token.
    cfg["unk_token"] = None
    cfg["additional_special_tokens"] = [IM_START, IM_END]
    cfg["model_max_length"] = model_max_length if model_max_length is not None else 1 << 30
    jinja = out / "chat_template.jinja"
    if tok.chat_template is not None:
        cfg["chat_template"] = tok.chat_template
    if jinja.exists():
        jinja.unlink()
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    special = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN,
               "additional_special_tokens": [IM_START, IM_END]}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def save_tokenizer(tokenizer_json: str, out_dir: str | Path | None, *,
                   with_chat_template: bool = True,
                   model_max_length: int | None = None) -> PreTrainedTokenizerFast:
    """Wrap a tokenizer.json as a transformers tokenizer (chat template); save it if out_dir."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    extra = {} if model_max_length is None else {"model_max_length": model_max_length}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tokenizer_json),
        bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START, IM_END], clean_up_tokenization_spaces=False,
        **extra)
    if with_chat_template:
        tok.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tok.save_pretrained(str(out))
        _write_portable_config(out, tok, model_max_length)
    return tok


def build_bpe_tokenizer(out_dir: str | Path | None, vocab_size: int = 512, *,
                        with_chat_template: bool = True,
                        model_max_length: int | None = None) -> PreTrainedTokenizerFast:
    """Train (deterministically) a byte-level BPE on the built-in corpus; save it if out_dir."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} (bytes + special "
                         f"tokens), got {vocab_size}")
    return save_tokenizer(_trained_tokenizer_json(vocab_size), out_dir,
                          with_chat_template=with_chat_template, model_max_length=model_max_length)
