"""Mask secrets in log text before it is shown, pasted or stored.

    >>> Redactor().redact("export HF_TOKEN=hf_" + "a1B2" * 9)
    'export HF_TOKEN=[REDACTED:hf_token]'
    >>> Redactor(extra=("hosts",)).redact("  host      : gpu-node-17.cluster.internal")
    '  host      : [REDACTED:host]'

Always masked: Hugging Face, GitHub, GitLab, AWS, W&B, OpenAI/Anthropic-style, Slack, Google API
keys, JWTs, PyPI upload tokens; values of `*_TOKEN=`, `*_KEY=`, `*_SECRET=`, `PASSWORD=`, `PASSWD=`
assignments (shell, env dumps, JSON, YAML, `--x-token VALUE`); `user:pass@` in URLs; bearer and
basic credentials; private key blocks (a BEGIN line masks the rest of its line, a bare base64 line
of 40+ characters is taken for a key body). Optional (`extra`): `hosts`, `paths` (user names in
home directories), `ips`. Loopback and wildcard addresses (`localhost`, `127.0.0.1`, `::`) carry no
secret and stay. Each line is redacted on its own, in one pass of one compiled expression; the
output of `redact` passes through `redact` unchanged.
"""

from __future__ import annotations

import re
from dataclasses import fields, is_dataclass, replace
from typing import Any, Callable, Iterable, Mapping

from logtriage.errors import UsageError

EXTRAS = ("hosts", "paths", "ips")
MARK = "[REDACTED:{}]"

# Specific token formats: (kind, expression). Also used to name the secret inside an assignment.
_TOKENS: tuple[tuple[str, str], ...] = (
    ("hf_token", r"(?<![\w-])(?:hf|api_org)_[A-Za-z0-9]{30,}(?![\w-])"),
    ("github_token", r"(?<![\w-])(?:gh[pousr]_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{22,})(?![\w-])"),
    ("gitlab_token", r"(?<![\w-])glpat-[A-Za-z0-9_-]{20,}"),
    ("aws_access_key", r"(?<![A-Za-z0-9])(?:AKIA|ASIA|ABIA|ACCA|AGPA|AIDA|AROA|AIPA|ANPA|ANVA|APKA)[A-Z0-9]{16}(?![A-Za-z0-9])"),
    ("anthropic_key", r"(?<![\w-])sk-ant-[A-Za-z0-9_-]{20,}"),
    ("openai_key", r"(?<![\w-])sk-(?:proj-|svcacct-|admin-)?[A-Za-z0-9_-]{20,}"),
    ("slack_token", r"(?<![\w-])(?:xox[abposr]|xapp)-[A-Za-z0-9-]{10,}"),
    ("google_api_key", r"(?<![\w-])AIza[0-9A-Za-z_-]{35}(?![\w-])"),
    ("pypi_token", r"(?<![\w-])pypi-AgE[A-Za-z0-9_-]{40,}"),
    ("jwt", r"(?<![\w-])eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"),
)
_TOKEN_KINDS = tuple((kind, re.compile(expr)) for kind, expr in _TOKENS)

# A name whose value is a secret: ends with TOKEN, SECRET, PASSWORD, PASSWD, PASSPHRASE, APIKEY,
# or _KEY / -KEY (a bare `key` is a dictionary key, `MAX_TOKENS` a count: neither is masked).
_SECRET_NAME = (r"(?i:[\w.-]*?(?:token|secret|password|passwd|passphrase|apikey|[_-]key|"
                r"[_-]credentials?|auth[_-]?code|private[_-]?key)(?!\w))")
SECRET_NAME = re.compile(rf"^{_SECRET_NAME}$")
# Tokenizer attributes that look like secrets by name only.
_NOT_SECRET_NAMES = re.compile(r"(?i)^(?:pad|eos|bos|unk|sep|cls|mask|additional_special|special|max|num)_tokens?$")


def _not_secret_name(name: str) -> bool:
    """A tokenizer attribute, in any spelling: `eos_token`, `eos-token`, `--pad-token`."""
    return bool(_NOT_SECRET_NAMES.match(name.strip("\"'-").replace("-", "_")))


# Values that hold nothing secret: empty, placeholders, booleans, references to another variable.
_PLACEHOLDER = re.compile(r"(?i)^(?:|none|null|nil|true|false|yes|no|\*+|x{3,}|\.{3}|<[^<>]*>|\$\{?\w+\}?|"
                          r"%\w+%|\[REDACTED:\w+\]|redacted|not set|unset|changeme)$")

# a banner's rule (`=== ... fault=grain_key ===`), read as a value after `grain_key =`
_RULE_CHARS = re.compile(r"^[=#~_-]+$")
# a count or a metric (`query_token: 0.0038` in a training log), not a secret
_SHORT_NUMBER = re.compile(r"^\d{1,8}(?:\.\d{1,8})?$")
# Lower-case config names that are secret only by their `_key` suffix (`full_key`, `sort_key`) hold
# code names: a dotted identifier without digits (`dataset.train_dataset`) is not a secret.
_WEAK_SECRET_NAME = re.compile(r"^(?!.*(?:api|secret|token|pass|private|auth|cred|access))[a-z_.-]*[_-]key$")
_IDENTIFIER_VALUE = re.compile(r"^[A-Za-z_]+(?:\.[A-Za-z_]+)+$")
# A plain lower-case word is prose, not a secret: `unique_by_key: failed to synchronize` (thrust).
_WORD_VALUE = re.compile(r"^[a-z]{2,20}$")
_HOST_NAME = r"[A-Za-z0-9][A-Za-z0-9_.\[\]-]*"
_FQDN_TLDS = ("com|net|org|edu|gov|io|ai|cloud|internal|local|lan|corp|intra|cluster|svc|localdomain|"
              "us|uk|de|fr|jp|cn|kr|ru|eu|ca|au|nl|ch|se|in|sg|tw|hk")
# Public sites whose names identify nobody (documentation links, model hubs, package hosting).
_PUBLIC_DOMAINS = re.compile(r"(?i)(?:^|\.)(?:github\.com|githubusercontent\.com|pytorch\.org|huggingface\.co|"
                             r"nvidia\.com|python\.org|readthedocs\.io|wandb\.ai|google\.com|microsoft\.com|"
                             r"amazonaws\.com|stackoverflow\.com|docker\.io|anaconda\.org)$")
_LOCAL = re.compile(r"(?i)^(?:localhost(?:\.localdomain)?|127(?:\.\d{1,3}){3}|0\.0\.0\.0|::1?|\[::1?\]|ip6-localhost)$")
_IPV4 = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)(?:\.(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)){3}"
_IP_LITERAL = re.compile(rf"^(?:{_IPV4}|[0-9A-Fa-f:]*:[0-9A-Fa-f:.]*)$")
_H4 = r"[0-9A-Fa-f]{1,4}"

# (group name, expression, option it needs or None). Order matters: at one position the first wins.
_PATTERNS: tuple[tuple[str, str, str | None], ...] = (
    ("private_key", r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----"
                    r"(?:.*?-----END (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----|.*)", None),
    ("url_credentials", r"(?P<uc_scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)[^\s:/@'\"<>]+:[^\s/@'\"<>]+@", None),
    ("slack_webhook", r"https://hooks\.slack\.com/(?:services|workflows|triggers)/[A-Za-z0-9/_-]+", None),
    ("authorization", r"(?P<au_head>(?i:\bauthorization)[\"']?\s*[:=]\s*[\"']?(?i:(?:basic|token|bearer)\s+)?)"
                      r"(?!(?i:basic|token|bearer)\b)(?P<au_val>[A-Za-z0-9._~+/=-]{6,})", None),
    ("bearer_token", r"(?P<be_head>(?i:\bbearer)\s+)[A-Za-z0-9._~+/-]{8,}=*", None),
    ("netrc_password", r"(?P<ne_head>(?i:\bmachine\s+\S+\s+login\s+\S+\s+password)\s+)\S+", None),
    ("assignment", rf"(?P<as_name>(?<![\w.-])(?:--?)?[\"']?{_SECRET_NAME}[\"']?)"
                   r"(?P<as_sep>\s*[=:]\s*)"
                   r"(?:(?P<as_q>[\"'])(?P<as_qval>[^\"'\n]*)(?P=as_q)|(?P<as_val>\[REDACTED:\w+\]|(?![\w.-]+[=:][^=\s])[^\s'\"}\])&]+))", None),
    ("flag", r"(?P<fl_name>(?<![\w-])--[\w-]*?(?i:token|secret|password|passwd|api[_-]?key|[_-]key))\s+"
             r"(?![-\"'])(?P<fl_val>[^\s'\"]+)", None),
    *((kind, expr, None) for kind, expr in _TOKENS),
    ("wandb_key", r"(?P<wb_pre>(?i:wandb)[^\n]{0,80}?)(?<![0-9a-f-])(?:local-)?[0-9a-f]{40}(?![0-9a-f])", None),
    ("key_material", r"(?<![\w+/=])(?![/+])(?=[A-Za-z0-9+/]*[A-Z])(?=[A-Za-z0-9+/]*[a-z])(?=[A-Za-z0-9+/]*\d)"
                     r"[A-Za-z0-9+/]{40,}={0,2}$", None),
    # --- optional maskings ---
    ("user", r"(?P<us_pre>/(?:home|homes|Users|usr/home)/|(?i:\b[A-Z]:\\Users\\))(?P<us_name>[^/\\\s'\":\[\]]+)",
     "paths"),
    ("host_field", rf"(?P<hf_name>(?<![\w.-])(?:--?)?(?i:node|(?:[\w-]*[_-])?(?<!per_)(?:host|hostname|nodename|nodelist|"
                   rf"master[_-]addr|rdzv[_-]endpoint)))(?!\w)(?P<hf_sep>[\"']?\s*[:=]\s*[\"']?|\s+(?=[A-Za-z][\w-]*\d))"
                   rf"(?P<hf_val>{_HOST_NAME})", "hosts"),
    ("host_context", r"(?P<hc_pre>\bON\s+(?=\S+\s+CANCELLED)|\b(?:to|on|from) host\s+|\btcp://|"
                     r"\b[Cc]onnect(?:ion)? to\s+(?=[\w.-]+:\d)|\bsrun: error:\s+(?=[\w.-]+:\s))"
                     rf"(?P<hc_val>{_HOST_NAME})", "hosts"),
    ("nccl_prefix", r"(?<![\w.-])(?P<nc_val>[A-Za-z][\w.-]*)(?P<nc_rest>:\d+:\d+ \[\d+\])", "hosts"),
    ("shell_prompt", r"(?P<sp_user>\b\w[\w.-]*@)(?P<sp_val>[A-Za-z][\w.-]*)(?=:[~/])", "hosts"),
    ("aws_host", r"\bip-\d{1,3}-\d{1,3}-\d{1,3}-\d{1,3}(?:\.[\w-]+)*(?![\w-])", "hosts"),
    ("fqdn", rf"(?<![\w./-])(?<!://)(?P<fq_val>(?:[A-Za-z0-9](?:[A-Za-z0-9-]{{0,61}}[A-Za-z0-9])?\.)+"
             rf"(?i:{_FQDN_TLDS}))(?![\w-]|\.\w)", "hosts"),
    ("ipv4", rf"(?<![\w.])(?<!==)(?P<v4_val>{_IPV4})(?![\w]|\.\d)", "ips"),
    ("ipv6", rf"(?<![\w:.])(?P<v6_val>(?:{_H4}:){{7}}{_H4}|(?:{_H4}:){{2,6}}(?::{_H4}){{1,5}}|"
             rf"(?:{_H4}:){{1,5}}(?::{_H4}){{2,6}}|(?:{_H4}:){{2,6}}:|::(?:{_H4}:){{1,5}}{_H4})(?![\w:.])", "ips"),
)


# Every secret pattern needs one of these (lower-cased) or a base64 tail: most lines skip the full pass.
_HINT = re.compile("|".join(map(re.escape, (
    "token", "secret", "pass", "key", "credential", "auth", "bearer", "machine", "wandb", "private", "://",
    "hf_", "api_org_", "ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_", "glpat-", "sk-", "xox", "xapp-",
    "aiza", "pypi-", "eyj", "akia", "asia", "abia", "acca", "agpa", "aida", "aroa", "aipa", "anpa", "anva", "apka"))))
_KEY_TAIL = re.compile(r"[A-Za-z0-9+/]{40}={0,2}$")
_EXPRESSIONS = {name: expr for name, expr, _ in _PATTERNS}


def _combine(names: Iterable[str]) -> re.Pattern:
    return re.compile("|".join(f"(?P<{name}>{_EXPRESSIONS[name]})" for name in names), re.MULTILINE)


def _mark(kind: str) -> str:
    return MARK.format(kind)


_NAME_KINDS = (("aws_secret", "aws_secret_key"), ("wandb", "wandb_key"), ("hf_", "hf_token"),
               ("hugging", "hf_token"), ("openai", "openai_key"), ("github", "github_token"), ("pass", "password"),
               ("private", "private_key"))


def _kind_by_name(name: str) -> str:
    lowered = name.lower()
    return next((kind for part, kind in _NAME_KINDS if part in lowered), "secret")


def token_kind(value: str) -> str | None:
    """The kind of a well-known token format the whole value has, if any."""
    for kind, regex in _TOKEN_KINDS:
        m = regex.search(value)
        if m and m.group(0) == value:
            return kind
    return None


def _names_a_field(name: str, value: str) -> bool:
    """`'enable_thinking_key': 'enable_thinking'` (a config naming the field its value is read from):
    the value is the name without its `_key`, so it is a field name, not a secret."""
    return len(value) >= 3 and name.lower().rsplit("_key", 1)[0].rsplit("-key", 1)[0] == value.lower()


class Redactor:
    """Masks secrets (and the `extra` identity classes: hosts, paths, ips) in a line of text."""

    def __init__(self, extra: Iterable[str] = ()):
        self.extra = frozenset(extra)
        unknown = self.extra - set(EXTRAS)
        if unknown:
            raise UsageError(f"redaction extras are {', '.join(EXTRAS)} (got {', '.join(sorted(unknown))})")
        self._secrets = _combine(name for name, _, option in _PATTERNS if option is None)
        extras = [name for name, _, option in _PATTERNS if option in self.extra]
        self._extras = _combine(extras) if extras else None
        self._handlers: dict[str, Callable[[re.Match], str]] = {
            "url_credentials": lambda m: m.group("uc_scheme") + _mark("url_credentials") + "@",
            "authorization": lambda m: m.group("au_head") + _mark(token_kind(m.group("au_val")) or "authorization"),
            "bearer_token": lambda m: m.group("be_head") + _mark("bearer_token"),
            "netrc_password": lambda m: m.group("ne_head") + _mark("password"),
            "assignment": self._assignment,
            "wandb_key": lambda m: self.redact(m.group("wb_pre")) + _mark("wandb_key"),
            "user": lambda m: m.group("us_pre") + _mark("user"),
            "host_field": lambda m: m.group("hf_name") + m.group("hf_sep") + self._host(m.group("hf_val")),
            "host_context": lambda m: m.group("hc_pre") + self._host(m.group("hc_val")),
            "nccl_prefix": lambda m: self._host(m.group("nc_val")) + m.group("nc_rest"),
            "shell_prompt": lambda m: m.group("sp_user") + self._host(m.group("sp_val")),
            "fqdn": self._fqdn,
            "flag": self._flag,
            "aws_host": lambda m: _mark("host"),
            "ipv4": lambda m: self._ip(m.group("v4_val")),
            "ipv6": lambda m: self._ip(m.group("v6_val")),
        }

    def redact(self, text: str) -> str:
        if not text:
            return text
        if _HINT.search(text.lower()) or "\n" in text or _KEY_TAIL.search(text, max(0, len(text) - 44)):
            text = self._secrets.sub(self._replace, text)
        if self._extras is not None:
            text = self._extras.sub(self._replace, text)
        return text

    def redact_host(self, name: str) -> str:
        """A bare host name (a rank table's host column): masked when `hosts` is on."""
        if "hosts" not in self.extra or not name:
            return name
        return self._host(name)

    def redact_data(self, value: Any, key: str | None = None) -> Any:
        """Nested JSON-like data (probe facts, a report dict): every string redacted; a string
        under a secret-named key masked whole; under a host-named key treated as a host name."""
        if isinstance(value, str):
            if key is not None and SECRET_NAME.match(key) and not _not_secret_name(key) \
                    and not _PLACEHOLDER.match(value.strip()):
                return _mark(token_kind(value) or _kind_by_name(key))
            if key is not None and key.lower() in ("host", "hostname", "master_addr", "node", "nodename"):
                return self.redact_host(value) if "hosts" in self.extra else self.redact(value)
            return self.redact(value)
        if isinstance(value, Mapping):
            return {k: self.redact_data(v, str(k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self.redact_data(v, key) for v in value)
        return value

    def _replace(self, m: re.Match) -> str:
        handler = self._handlers.get(m.lastgroup)
        return handler(m) if handler else _mark(m.lastgroup)

    def _assignment(self, m: re.Match) -> str:
        name = m.group("as_name")
        quote = m.group("as_q") or ""
        value = m.group("as_qval") if quote else m.group("as_val")
        bare = name.strip("\"'-")
        plain = value.strip()
        listed = plain.rstrip(",;")   # a dict or argument list goes on after the value: `'x_token': False,`
        if _not_secret_name(bare) or _PLACEHOLDER.match(listed) or _SHORT_NUMBER.match(listed):
            return m.group(0)   # a short number is a counter or an index, not a secret (store_based_barrier_key:2)
        if _RULE_CHARS.match(listed):
            return m.group(0)   # a banner's rule, not a value: the closing `===` after `fault=grain_key`
        if _WEAK_SECRET_NAME.match(bare) and (_IDENTIFIER_VALUE.match(plain) or _WORD_VALUE.match(plain)
                                               or _names_a_field(bare, plain)) and not token_kind(value):
            return m.group(0)   # full_key: dataset.train_dataset; unique_by_key: failed to synchronize
        kind = token_kind(value) or _kind_by_name(bare)
        return f"{name}{m.group('as_sep')}{quote}{_mark(kind)}{quote}"

    def _flag(self, m: re.Match) -> str:
        value = m.group("fl_val")
        bare = m.group("fl_name").lstrip("-").replace("-", "_")
        # argparse's usage line names each option's value by its metavar (`[--eos-token EOS_TOKEN]`: public139)
        if _PLACEHOLDER.match(value) or _not_secret_name(bare) or value.rstrip("]).,") == bare.upper():
            return m.group(0)
        return m.group(0)[:m.start("fl_val") - m.start()] + _mark(token_kind(value) or _kind_by_name(m.group("fl_name")))

    def _fqdn(self, m: re.Match) -> str:
        name = m.group("fq_val")
        labels = name.split(".")
        # `threading.local`, `torchvision.io`: two-label names are code unless the TLD is generic.
        if len(labels) < 3 and labels[-1].lower() not in ("com", "net", "org", "edu", "gov"):
            return name
        return self._host(name)

    def _host(self, name: str) -> str:
        if _LOCAL.match(name) or name.isdigit():
            return name
        if _IP_LITERAL.match(name):
            return self._ip(name)
        if _PUBLIC_DOMAINS.search(name):
            return name
        return _mark("host")

    def _ip(self, address: str) -> str:
        if "ips" not in self.extra or _LOCAL.match(address):
            return address
        return _mark("ip")


# Report fields that come from the catalog or the analysis, never from the log: left as they are.
_DIAGNOSIS_FIELDS = frozenset({"rule_id", "category", "title", "role", "status", "verdict", "layer", "stream",
                               "kind", "explanation", "fix", "misdiagnosis", "redaction"})


def redact_report(report: Any, redactor: Redactor) -> Any:
    """The report (any frozen dataclass tree) with every log-derived string redacted, including
    the ones `build_report` leaves alone: environment facts, notes, source names, rank hosts."""
    if is_dataclass(report) and not isinstance(report, type):
        changes = {f.name: _redact_field(getattr(report, f.name), redactor, f.name)
                   for f in fields(report) if f.name not in _DIAGNOSIS_FIELDS}
        return replace(report, **changes)
    return _redact_field(report, redactor, None)


def _redact_field(value: Any, redactor: Redactor, name: str | None) -> Any:
    if isinstance(value, str):
        return redactor.redact_host(value) if name == "host" else redactor.redact(value)
    if is_dataclass(value) and not isinstance(value, type):
        return redact_report(value, redactor)
    if isinstance(value, tuple):
        return tuple(_redact_field(v, redactor, name) for v in value)
    if isinstance(value, Mapping):
        return redactor.redact_data(dict(value))
    return value
