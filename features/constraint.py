"""What structured output must match, without torch: a Constraint (JSON Schema, any JSON object, a regex or a
grammar), checked and turned into llguidance's grammar; a Grammar (a constraint compiled against a vocabulary, by
grammar.Compiler) and a Matcher, one sequence's position in it. llguidance is imported where it is used; the masks
over the logits (tensors) are grammar.py's.
"""
import json
import os
from dataclasses import dataclass

KINDS = ("json_schema", "json_object", "regex", "grammar", "lark")
# One line of JSON with json.dumps's separators: what models write, and no room for runs of whitespace.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Constraint:
    """What the output must match. spec: the JSON Schema as JSON text, the regex, the grammar text (Lark, or
    llama.cpp's GBNF); "" for json_object (any JSON object). "lark" is llguidance's Lark taken as it is, never
    guessed to be GBNF: what tools.py builds (its tool calls' grammars)."""
    kind: str
    spec: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown constraint kind {self.kind!r}; expected one of {', '.join(KINDS)}")


def json_schema_arg(value: str) -> str:
    """A JSON Schema given as a file path or as JSON text -> its JSON text; ValueError when it is neither."""
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                value = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read JSON schema file: {e}") from None
    try:
        schema = json.loads(value)
    except ValueError as e:
        raise ValueError(f"the JSON schema is neither a file nor valid JSON ({e})") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"a JSON schema must be an object, got {value[:50]}")
    return json.dumps(schema)


def to_llguidance(constraint: Constraint) -> str:
    """The constraint as an llguidance grammar (its JSON text); ValueError for a spec that is not even parseable."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    if constraint.kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if constraint.kind == "json_schema":
        try:
            return LLMatcher.grammar_from_json_schema(constraint.spec, defaults=JSON_OPTIONS)
        except ValueError as e:
            raise ValueError(f"invalid JSON schema: {e}") from None
    if constraint.kind == "regex":
        return LLMatcher.grammar_from_regex(constraint.spec)
    if constraint.kind == "lark":
        return LLMatcher.grammar_from_lark(constraint.spec)
    try:  # Lark (a `start:` rule) as it is; GBNF (llama.cpp's `root ::= ...`) converted to Lark
        return LLMatcher.grammar_from_lark(any_to_lark(constraint.spec))
    except Exception as e:  # the converter raises GbnfToLarkError, or a plain Exception for an unknown rule
        raise ValueError(f"invalid GBNF grammar: {one_line(str(e))}") from None


def check_constraint(constraint: Constraint) -> None:
    """A ValueError naming what is wrong with a schema, regex or grammar; needs no tokenizer (runs before loading).
    What only shows once it meets a vocabulary (a grammar matching no text, a limit hit) is Compiler.compile's."""
    from llguidance import LLMatcher

    is_error, messages = LLMatcher.validate_grammar_with_warnings(to_llguidance(constraint), limits=limits())
    if is_error:
        raise ValueError(f"invalid {constraint.kind.replace('_', ' ')}: {one_line(messages[0])}")


def limits():
    """llguidance's default limits, with errors that do not carry its parser state and the grammar (a dump of
    kilobytes that would reach the client)."""
    from llguidance import LLParserLimits

    return LLParserLimits(verbose_errors=False)


def one_line(message: str) -> str:
    return " ".join(message.replace("<non-verbose/>", "").split())[:300]


def matcher_error(matcher) -> str:
    """Why an llguidance.LLMatcher is in its error state, in one line."""
    message = one_line(matcher.get_error())
    # llguidance's name for a mask with no token allowed, not even EOS
    return "no token can continue the text here" if message == "NoExtensionBias" else message


class Matcher:
    """One sequence's position in its grammar: which tokens may come next, and the tokens taken so far."""

    def __init__(self, matcher):
        self.matcher = matcher  # an llguidance.LLMatcher

    def fill(self, row) -> None:
        """Write the allowed next tokens into row, a contiguous (W,) int32 CPU tensor (bit i of word w: id 32w+i).
        ValueError when the grammar hits one of llguidance's limits here (Compiler.compile tried the first steps)."""
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        if self.matcher.is_error():
            raise ValueError(f"the structured output's grammar failed: {matcher_error(self.matcher)}")

    def advance(self, token: int) -> None:
        """Take a sampled token (one the mask allowed). ValueError when the grammar hits one of llguidance's limits
        taking it (the mask allowed it, but lexing its text went past a limit)."""
        if not self.matcher.consume_token(token):
            raise ValueError(f"the structured output's grammar failed at token {token}: "
                             f"{matcher_error(self.matcher)}")

    def rollback(self, n: int) -> None:
        """Forget the last n tokens taken (no more than were taken: the caller's to ensure)."""
        ok = self.matcher.rollback(n)  # outside the assert: `python -O` drops asserts, and the rollback with them
        assert ok, one_line(self.matcher.get_error())

    @property
    def can_end(self) -> bool:
        """The output so far is complete: EOS is allowed now."""
        return self.matcher.is_accepting()

    @property
    def done(self) -> bool:
        """Nothing but EOS can follow (or EOS was taken): the sequence ends here."""
        return self.matcher.is_stopped()


class Grammar:
    """A constraint compiled against a vocabulary; matcher() starts a sequence at its beginning."""

    def __init__(self, constraint: Constraint, template):
        self.constraint = constraint
        self.template = template  # a fresh llguidance.LLMatcher; copies share its compiled grammar

    def matcher(self) -> Matcher:
        return Matcher(self.template.deep_copy())
