"""Conversations as training documents: rendered with the tokenizer's own chat template (jinja2,
as `transformers`' apply_chat_template renders it) and tokenized whole, with a per-token loss
mask that says which tokens are trained on.

Which tokens (`--train-on`): `all`; `assistant` (every assistant turn: its content and what the
template puts after it, e.g. the end-of-turn token, so the model learns to stop); `last` (the
final assistant turn only). An assistant turn is the text the template adds between the
conversation up to it, rendered with the generation prompt, and the conversation through it.
Templates that rewrite earlier turns once a later one exists (some drop past reasoning) have no
such span; they are an error naming `--train-on all` and `--chat-template`.

The mask is stored per target token: mask[j] = 1 when token j is predicted (from tokens < j)
in training.
"""

import dataclasses
import json
import pathlib

import numpy as np

from spmd.core.errors import UserError

ROLES = ("system", "user", "assistant", "tool")
TRAIN_ON = ("all", "assistant", "last")
TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"  # a prepared directory's copy of the template it rendered with
# The special tokens transformers passes to a template by name (its special_tokens_map).
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _environment():
    """A jinja2 environment that renders as transformers' does: sandboxed, trim_blocks and
    lstrip_blocks, loop controls, its tojson, raise_exception and strftime_now, and the
    `{% generation %}` tag (rendered as its body)."""
    import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception, strftime_now=lambda f: datetime.datetime.now().strftime(f)
    )
    return env


def tokenizer_config(tokenizer) -> dict:
    """The tokenizer_config.json beside a tokenizer's file ({} where there is none)."""
    tokenizer_file = getattr(tokenizer, "file", None)
    path = pathlib.Path(tokenizer_file).with_name(TOKENIZER_CONFIG) if tokenizer_file else None
    if path is None or not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path} is not readable JSON ({e})") from None
    return config if isinstance(config, dict) else {}


def special_tokens(config: dict) -> dict:
    """bos_token, eos_token, ... as text, from a tokenizer_config.json's entries."""
    special = {}
    for name in SPECIAL_TOKENS:
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            special[name] = value
    return special


def end_of_text_id(tokenizer) -> int | None:
    """The id transformers calls eos_token_id (tokenizer_config.json's eos_token), else the
    tokenizer's own EOS."""
    eos = special_tokens(tokenizer_config(tokenizer)).get("eos_token")
    inner = getattr(tokenizer, "tokenizer", None)
    found = inner.token_to_id(eos) if eos is not None and inner is not None else None
    return found if found is not None else tokenizer.eos_id


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    source: str  # the jinja text
    special: dict  # bos_token etc., as the template sees them
    origin: str  # where it came from (for messages)

    @classmethod
    def load(cls, tokenizer, override: str = "") -> "ChatTemplate":
        """The template of `tokenizer`: chat_template.jinja beside its file, else `chat_template` in
        the tokenizer_config.json there; or the jinja file `override` (--chat-template)."""
        tokenizer_file = getattr(tokenizer, "file", None)
        config_path = pathlib.Path(tokenizer_file).with_name(TOKENIZER_CONFIG) if tokenizer_file else None
        own_file = pathlib.Path(tokenizer_file).with_name(TEMPLATE_FILE) if tokenizer_file else None
        config = tokenizer_config(tokenizer)
        special = special_tokens(config)
        if override:
            path = pathlib.Path(override).expanduser()
            try:
                return cls(path.read_text(), special, str(path))
            except (OSError, UnicodeDecodeError) as e:
                raise UserError(f"--chat-template {override!r} cannot be read: {e}") from None
        if own_file is not None and own_file.is_file():  # as transformers: this file wins
            return cls(own_file.read_text(), special, str(own_file))
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: the default one
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        if not isinstance(source, str):
            where = str(config_path) if config_path is not None and config_path.is_file() else "the tokenizer"
            raise UserError(
                f"{where} has no chat_template for tokenizer {getattr(tokenizer, 'name', tokenizer)}; pass "
                f"--chat-template FILE (a jinja chat template)"
            )
        return cls(source, special, str(config_path))

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        import jinja2

        try:
            return _compiled(self.source).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special
            )
        except jinja2.TemplateError as e:
            raise UserError(f"chat template {self.origin}: {e}") from None
        except Exception as e:  # noqa: BLE001 — the template's own code failed (the sandbox's limits included)
            raise UserError(
                f"chat template {self.origin} failed while rendering ({type(e).__name__}: {str(e)[:200]}); fix the "
                f"template or pass --chat-template FILE"
            ) from None


_cache: dict[str, object] = {}


def _compiled(source: str):
    if source not in _cache:
        import jinja2

        try:
            _cache[source] = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise UserError(f"the chat template is not valid jinja (line {e.lineno}: {e.message})") from None
    return _cache[source]


def stop_ids(tokenizer, template: ChatTemplate) -> set[int]:
    """The tokens that end an assistant turn: the template's eos_token and the tokenizer's EOS."""
    ids = {tokenizer.eos_id} if tokenizer.eos_id is not None else set()
    eos = template.special.get("eos_token")
    if eos is not None and getattr(tokenizer, "tokenizer", None) is not None:
        found = tokenizer.tokenizer.token_to_id(eos)
        if found is not None:
            ids.add(found)
    return ids


def check_messages(messages, where: str, train_on: str) -> None:
    """A conversation as the data must give it: a non-empty list of {role, content} with known
    roles and string content, and an assistant turn when one is to be trained on."""
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise UserError(f"{where}: message {k} must be an object with a 'role' and a 'content'")
        if m["role"] not in ROLES:
            raise UserError(
                f"{where}: message {k} has the unknown role {m['role']!r}; roles are {', '.join(ROLES)}"
            )
        if not isinstance(m.get("content"), str):
            raise UserError(f"{where}: message {k} ({m['role']}) has no text 'content'")
    if train_on != "all" and not any(m["role"] == "assistant" for m in messages):
        raise UserError(
            f"{where}: the conversation has no assistant turn to train on (--train-on {train_on}); "
            f"drop it, or pass --train-on all"
        )


def spans(template: ChatTemplate, messages: list[dict], train_on: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans trained on."""
    text = template.render(messages)
    if train_on == "all":
        return text, [(0, len(text))]
    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    if train_on == "last":
        turns = turns[-1:]
    found = []
    for k in turns:
        before = template.render(messages[:k], add_generation_prompt=True) if k else ""
        through = template.render(messages[: k + 1])
        if not (text.startswith(through) and through.startswith(before)):
            raise UserError(
                f"chat template {template.origin} renders earlier turns differently once later ones follow, so "
                f"assistant turn {k} has no span of its own; pass --train-on all, or a --chat-template that keeps "
                f"past turns as they were"
            )
        found.append((len(before), len(through)))
    return text, found


def mask_tokens(tokenizer, text: str, trained: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, loss mask) of a rendered conversation: the whole text tokenized without added
    special tokens (as apply_chat_template does; the template places BOS itself), and 1 for each
    token whose text starts inside a trained span."""
    ids, starts = tokenizer.encode_with_offsets(text)
    mask = np.zeros(len(ids), np.uint8)
    for lo, hi in trained:
        mask[(starts >= lo) & (starts < hi)] = 1
    return ids, mask


def encode(
    tokenizer, template: ChatTemplate, messages: list[dict], train_on: str
) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, loss mask) of one conversation."""
    return mask_tokens(tokenizer, *spans(template, messages, train_on))
