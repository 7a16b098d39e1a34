"""A plain Hugging Face fast tokenizer served by the `tokenizers` library alone.

A folder whose tokenizer_config.json names the generic fast class (`PreTrainedTokenizerFast` or
`TokenizersBackend`) is, for transformers, tokenizer.json plus special-token names and a chat
template. `FastTokenizer` loads exactly that in a few milliseconds, where importing transformers
takes seconds, and answers what the engine, the detokenizer and the server ask of a tokenizer with
the same results. `plain_fast_config` refuses (with the reason) every folder where transformers
would change the Rust tokenizer on load (tokens to add, flags to rewrite, a rebuilt
post-processor, a patched regex, a clean-up pass); those load through transformers.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from peregrine.tokenizer.chat_template import render_chat_template

# transformers' named special tokens, in its order (SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                       "mask_token")
PLAIN_FAST_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
# NOTE: transformers patches the pre-tokenizer regex of some Mistral tokenizers above this size.
_MAX_PLAIN_VOCAB = 100_000
_NO_MAX_LENGTH = int(1e30)  # transformers' model_max_length when the config has none
_DEFAULT_INPUT_NAMES = ("input_ids", "attention_mask")  # transformers 5's default
_FLAGS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")


def _token_text(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"a special token is a string or an AddedToken dict, not {value!r}")


def _flags(token: Any) -> tuple:
    if isinstance(token, dict):
        return (token.get("content"), bool(token.get("single_word", False)),
                bool(token.get("lstrip", False)), bool(token.get("rstrip", False)),
                bool(token.get("normalized", True)), bool(token.get("special", False)))
    return tuple(getattr(token, f) for f in _FLAGS)


def plain_fast_config(folder: str | Path) -> tuple[dict[str, Any] | None, str]:
    """The folder's tokenizer configuration (special tokens merged in, the chat template read)
    when FastTokenizer loads it exactly as transformers does; otherwise None and the reason."""
    folder = Path(folder)
    if not (folder / "tokenizer.json").is_file():
        return None, "no tokenizer.json"
    cfg_path = folder / "tokenizer_config.json"
    if not cfg_path.is_file():
        return None, "no tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cls = cfg.get("tokenizer_class")
    if cls not in PLAIN_FAST_CLASSES:
        return None, f"tokenizer_class {cls!r} has a class of its own in transformers"
    for key, why in (("auto_map", "remote code"), ("add_bos_token", "a rebuilt post-processor"),
                     ("add_eos_token", "a rebuilt post-processor")):
        if key in cfg:
            return None, f"{key} ({why})"
    if cfg.get("clean_up_tokenization_spaces") or cfg.get("split_special_tokens"):
        return None, "clean_up_tokenization_spaces or split_special_tokens is set"
    if (folder / "added_tokens.json").exists() or (folder / "additional_chat_templates").exists():
        return None, "added_tokens.json or additional_chat_templates"
    if "added_tokens_decoder" not in cfg and (folder / "special_tokens_map.json").is_file():
        # NOTE: transformers reads the legacy special_tokens_map.json only in this case.
        for key, value in json.loads((folder / "special_tokens_map.json").read_text("utf-8")).items():
            cfg[key] = value
    if "additional_special_tokens" in cfg and not cfg.get("extra_special_tokens"):
        cfg["extra_special_tokens"] = cfg.pop("additional_special_tokens")
    extra = cfg.get("extra_special_tokens") or []
    if not isinstance(extra, list):
        return None, "model-specific special tokens"
    if any(k.endswith("_token") and k not in SPECIAL_TOKEN_NAMES and isinstance(v, (str, dict))
           for k, v in cfg.items()):
        return None, "model-specific special tokens"
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        cfg["chat_template"] = jinja.read_text(encoding="utf-8")
    if not isinstance(cfg.get("chat_template"), (str, type(None))):
        return None, "several named chat templates"
    cfg["_extra_special_tokens"] = [_token_text(t) for t in extra]
    return cfg, ""


def _check_backend(backend: Any, cfg: dict[str, Any]) -> str:
    """Why transformers would change `backend` on load ("" when it would not)."""
    if backend.get_vocab_size(with_added_tokens=True) > _MAX_PLAIN_VOCAB \
            and backend.pre_tokenizer is not None:
        return "a vocabulary large enough for transformers' pre-tokenizer patch"
    if backend.post_processor is None:
        return "no post-processor (transformers builds one)"
    added = backend.get_added_tokens_decoder()
    for tid, token in (cfg.get("added_tokens_decoder") or {}).items():
        if int(tid) not in added or _flags(added[int(tid)]) != _flags(token):
            return f"added token {tid} differs from tokenizer.json's"
    by_text = {t.content: t for t in added.values()}
    default = (False, False, False, False, True)  # single_word, lstrip, rstrip, normalized, special
    named = [_token_text(cfg.get(n)) for n in SPECIAL_TOKEN_NAMES]
    for text in [*named, *cfg["_extra_special_tokens"]]:
        if text is None:
            continue
        token = by_text.get(text)
        if token is None or not token.special:
            return f"special token {text!r} is not a special added token of tokenizer.json"
        if "added_tokens_decoder" not in cfg and _flags(token)[1:] != default:
            return f"special token {text!r} would be re-added with other flags"
    return ""


class FastTokenizer:
    """encode / decode / chat template of a plain fast tokenizer folder (transformers' names and
    results: `encode`, `decode`, `__call__`, `apply_chat_template`, special tokens and ids,
    `convert_ids_to_tokens`, `backend_tokenizer`, ...)."""

    is_fast = True

    def __init__(self, backend: Any, config: dict[str, Any], name_or_path: str) -> None:
        self._tokenizer = backend
        self.name_or_path = name_or_path
        self.chat_template: str | None = config.get("chat_template")
        self.model_max_length: int = int(config.get("model_max_length") or _NO_MAX_LENGTH)
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces"))
        self.model_input_names = list(config.get("model_input_names") or _DEFAULT_INPUT_NAMES)
        self._special = {n: _token_text(config.get(n)) for n in SPECIAL_TOKEN_NAMES}
        self.extra_special_tokens: list[str] = list(config["_extra_special_tokens"])
        self.init_kwargs = {k: v for k, v in config.items() if not k.startswith("_")
                            and k not in ("tokenizer_class", "added_tokens_decoder")}
        self.init_kwargs["name_or_path"] = name_or_path
        # NOTE: transformers encodes without truncation or padding unless asked to.
        backend.no_truncation()
        backend.no_padding()

    @classmethod
    def from_folder(cls, folder: str | Path) -> FastTokenizer:
        """Load a folder that plain_fast_config accepts; ValueError (with the reason) otherwise."""
        from tokenizers import Tokenizer
        cfg, why = plain_fast_config(folder)
        if cfg is None:
            raise ValueError(f"{folder}: not a plain fast tokenizer ({why})")
        backend = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
        why = _check_backend(backend, cfg)
        if why:
            raise ValueError(f"{folder}: not a plain fast tokenizer ({why})")
        return cls(backend, cfg, str(folder))

    # ---- vocabulary ---------------------------------------------------------------------------
    @property
    def backend_tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """The base vocabulary's size, without added tokens."""
        return self._tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def __bool__(self) -> bool:
        return True

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    @property
    def added_tokens_decoder(self) -> dict[int, Any]:
        return self._tokenizer.get_added_tokens_decoder()

    @property
    def added_tokens_encoder(self) -> dict[str, int]:
        return {t.content: i for i, t in sorted(self.added_tokens_decoder.items())}

    def get_added_vocab(self) -> dict[str, int]:
        return self.added_tokens_encoder

    def convert_ids_to_tokens(self, ids: int | Sequence[int], skip_special_tokens: bool = False
                              ) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._tokenizer.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self._token_id(tokens)
        return [self._token_id(t) for t in tokens]

    def _token_id(self, token: str | None) -> int | None:
        if token is None:
            return None
        index = self._tokenizer.token_to_id(token)
        return self.unk_token_id if index is None else index

    # ---- special tokens -----------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        # bos_token, bos_token_id, ... for every named special token
        special = self.__dict__.get("_special")
        if special is not None:
            if name in special:
                return special[name]
            if name.endswith("_id") and name[:-3] in special:
                return self._token_id(special[name[:-3]])
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens that are set (transformers 5's special_tokens_map)."""
        return {n: t for n, t in self._special.items() if t is not None}

    @property
    def all_special_tokens(self) -> list[str]:
        out: list[str] = []
        for t in [*self.special_tokens_map.values(), *self.extra_special_tokens]:
            if t not in out:
                out.append(t)
        return out

    @property
    def all_special_ids(self) -> list[int]:
        return [self._token_id(t) for t in self.all_special_tokens]

    # ---- encode / decode ----------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, not {type(text).__name__}")
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str | list[str], add_special_tokens: bool = True,
                 return_offsets_mapping: bool = False, return_token_type_ids: bool | None = None,
                 return_attention_mask: bool | None = None) -> dict[str, list]:
        """input_ids (and token_type_ids, attention_mask, offset_mapping) of one text or a list."""
        batched = isinstance(text, list)
        if not batched and not isinstance(text, str):
            raise TypeError(f"the tokenizer takes a str or a list of str, not {type(text).__name__}")
        encs = self._tokenizer.encode_batch(text if batched else [text],
                                            add_special_tokens=add_special_tokens)
        if return_token_type_ids is None:
            return_token_type_ids = "token_type_ids" in self.model_input_names
        if return_attention_mask is None:
            return_attention_mask = "attention_mask" in self.model_input_names
        fields = [("input_ids", "ids", True), ("token_type_ids", "type_ids", return_token_type_ids),
                  ("attention_mask", "attention_mask", return_attention_mask),
                  ("offset_mapping", "offsets", return_offsets_mapping)]
        out = {}
        for key, attr, wanted in fields:
            if wanted:
                values = [getattr(e, attr) for e in encs]
                out[key] = values if batched else values[0]
        return out

    def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        text = self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        cleanup = (self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None
                   else clean_up_tokenization_spaces)
        # NOTE: transformers skips its WordPiece-era clean-up for BPE models (it strips real spaces).
        if cleanup and type(self._tokenizer.model).__name__ != "BPE":
            for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                         (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"),
                         (" 're", "'re")):
                text = text.replace(a, b)
        return text

    def batch_decode(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = False,
                     clean_up_tokenization_spaces: bool | None = None) -> list[str]:
        return [self.decode(s, skip_special_tokens, clean_up_tokenization_spaces) for s in sequences]

    # ---- chat ---------------------------------------------------------------------------------
    def get_chat_template(self, chat_template: str | None = None) -> str:
        template = chat_template if chat_template is not None else self.chat_template
        if template is None:
            raise ValueError("the tokenizer has no chat template; pass chat_template=...")
        return template

    def apply_chat_template(self, conversation: list[dict[str, Any]], tools: list[dict] | None = None,
                            documents: list[dict] | None = None, chat_template: str | None = None,
                            add_generation_prompt: bool = False,
                            continue_final_message: bool | str = False, tokenize: bool = True,
                            **kwargs: Any) -> str | list[int]:
        """The conversation rendered with the chat template (token ids unless tokenize=False;
        the rendered text holds its special tokens, so none are added)."""
        for reserved in ("padding", "truncation", "max_length", "return_tensors", "return_dict",
                         "return_assistant_tokens_mask", "tokenizer_kwargs"):
            if kwargs.get(reserved):
                raise ValueError(f"apply_chat_template: {reserved} is not supported here")
            kwargs.pop(reserved, None)
        text = render_chat_template(
            self.get_chat_template(chat_template), conversation,
            special_tokens=self.special_tokens_map, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tools=tools, documents=documents,
            **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    # ---- interop ------------------------------------------------------------------------------
    def transformers_tokenizer(self) -> Any:
        """The same folder loaded by transformers (for libraries that need its class: xgrammar)."""
        tok = self.__dict__.get("_hf")
        if tok is None:
            from transformers import AutoTokenizer
            tok = AutoTokenizer.from_pretrained(self.name_or_path, trust_remote_code=False,
                                                local_files_only=True)
            self.__dict__["_hf"] = tok
        return tok

    @property
    def tokenizer_class(self) -> str:
        """The class transformers would load this folder as (what /tokenizer_info reports)."""
        from importlib.metadata import PackageNotFoundError, version
        try:
            major = int(version("transformers").split(".")[0])
        except (PackageNotFoundError, ValueError):
            major = 5
        return "TokenizersBackend" if major >= 5 else "PreTrainedTokenizerFast"

    def __repr__(self) -> str:
        return f"FastTokenizer(name_or_path={self.name_or_path!r}, vocab_size={len(self)})"
