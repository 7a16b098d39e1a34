"""GET /tokenizer_info: the tokenizer's configuration as vLLM serves it (what lm-eval's remote
tokenizer backend reads: eos/bos/pad tokens, the chat template), as JSON."""
from __future__ import annotations

from typing import Any

# NOTE: paths on the server's disk say nothing a client can use and should not leave the machine.
_PATH_KEYS = frozenset({"vocab_file", "merges_file", "tokenizer_file", "name_or_path",
                        "spm_file", "sp_model_kwargs"})


def _jsonable(value: Any) -> Any:
    """Plain JSON values: AddedToken -> its text, dict keys -> strings, other objects -> str."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    content = getattr(value, "content", None)  # tokenizers.AddedToken
    if isinstance(content, str):
        return content
    return str(value)


def tokenizer_info(tokenizer: Any) -> dict[str, Any]:
    """The tokenizer's init kwargs (special tokens as strings, no file paths), its class name,
    chat template and model_max_length."""
    info = {k: _jsonable(v) for k, v in dict(getattr(tokenizer, "init_kwargs", None) or {}).items()
            if k not in _PATH_KEYS}
    # NOTE: the live attributes win over init kwargs: special tokens or a template set after load.
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        if hasattr(tokenizer, name):
            info[name] = _jsonable(getattr(tokenizer, name))
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        info["chat_template"] = template
    elif template is None:
        info.pop("chat_template", None)
    max_len = getattr(tokenizer, "model_max_length", None)
    if isinstance(max_len, int):
        info["model_max_length"] = max_len
    # NOTE: a FastTokenizer names the transformers class it stands in for.
    name = getattr(tokenizer, "tokenizer_class", None)
    info["tokenizer_class"] = name if isinstance(name, str) else type(tokenizer).__name__
    return info
