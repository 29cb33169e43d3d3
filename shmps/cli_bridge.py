"""``shmps-tool members``: a running bridge's member list, and changes to it.

Without ``--add`` / ``--remove`` it reads the bridge's ``GET /health`` (no secret needed)
and prints every member with its state. With them it sends ``POST /v1/members`` signed
for that bridge and for the store of ``--store`` (``auth.sign_request``, with the secret
of ``--secret-file``, or the empty key of a bridge run without one), checks the signed
answer (``auth.check_response``: any process on that address could answer) and prints
the new member list; a bridge of another store refuses the change (409), and the tool
says which store it serves. The bridge
applies the change on every member (docs/bridge-protocol.md, section 10); the change is
not written to hosts.txt.

Uses only the standard library's ``urllib``: the tool does not need aiohttp.
"""
from __future__ import annotations

import argparse
import http.client
import json
import sys
import urllib.error
import urllib.request
from typing import Any, Optional

from .cli_args import MAX_SECONDS, positive
from .errors import Error, InvalidArgument, Timeout

#: the largest answer read (a /health of thousands of shards is a few hundred KiB)
MAX_ANSWER_BYTES = 16 << 20
#: who the request's MAC names as its sender (the bridge logs it with the change)
CLIENT_ID = "operator"


#: no proxy: the bridges reach each other directly, and so does the tool (a proxy from
#: the environment would answer for the bridge, and its errors be blamed on it)
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _request(target: str, method: str, path: str, body: Optional[bytes],
             headers: dict[str, str], timeout: float) -> tuple[int, Any, bytes]:
    """(status, headers, body) of one request to the bridge at ``target``; a bridge
    that cannot be reached, or an answer that is not HTTP, is an :class:`Error` that
    says what to check."""
    from .bridge.members import http_url
    req = urllib.request.Request(http_url(target, path), data=body, method=method,
                                 headers={"Content-Type": "application/json", **headers})
    try:
        with _OPENER.open(req, timeout=timeout) as r:
            return r.status, r.headers, r.read(MAX_ANSWER_BYTES)
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read(MAX_ANSWER_BYTES)
    except http.client.HTTPException as e:   # not an HTTP server: another port
        raise Error(f"{target} did not answer {method} {path} as an HTTP server "
                    f"({type(e).__name__}: {e})", hint="is it shmps-bridge's --listen "
                    "address, as hosts.txt lists it?") from None
    except (TimeoutError, OSError) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, TimeoutError) or "timed out" in str(reason):
            raise Timeout(f"the bridge at {target} did not answer {method} {path} within "
                          f"{timeout:g} s", hint="is it stopped (SIGSTOP) or overloaded? "
                          "try again, or pass a larger --timeout") from None
        raise Error(f"cannot reach a bridge at {target}: {reason}",
                    hint="is shmps-bridge running there? pass the address it listens on, "
                         "its --listen as hosts.txt lists it") from None


def _loads(body: bytes) -> Any:
    """The JSON of an answer, or None where it is none: not JSON, not UTF-8, or nested
    deeper than the parser goes (RecursionError, which was an internal error)."""
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None


def _error_of(body: bytes) -> str:
    answer = _loads(body)
    if isinstance(answer, dict) and "error" in answer:
        return str(answer["error"])
    return body[:200].decode("utf-8", "replace")


def _json_object(target: str, what: str, body: bytes, keys: tuple) -> dict:
    """The answer ``body`` as a JSON object holding ``keys``, else an Error: it is not
    a bridge's answer."""
    answer = _loads(body)
    if not isinstance(answer, dict) or not all(k in answer for k in keys):
        raise Error(f"the answer of {target} to {what} is not a bridge's ({body[:80]!r})",
                    hint="is it shmps-bridge's --listen address, as hosts.txt lists it?")
    return answer


def _print_health(target: str, health: dict) -> None:
    print(f"bridge {target}: epoch {health.get('epoch')}, "
          f"{'has' if health.get('quorum') else 'lacks'} a majority "
          f"({'owns shards' if health.get('acting') else 'owns no shards'})"
          # (the store a change must name with --store: said here, where an operator
          # looks first)
          + (f"; store {health['store']!r}" if isinstance(health.get("store"), str) else ""))
    for m in health["members"]:   # (checked: objects with a string address and state)
        mark = "  (this bridge)" if m["address"] == health.get("address") else ""
        print(f"  {m['address']:<40} {m['state']}{mark}")


def _wrong_store(target: str, asked: str, serves: str, change: bool = True) -> Error:
    """The error of a bridge that serves store ``serves`` asked about store ``asked``
    (``change``: to change its members, which it refused; else to list them)."""
    from .bridge import auth
    if change:
        return auth.StoreMismatch(
            f"the bridge at {target} serves store {serves!r}, not {asked!r} (--store): "
            "nothing was changed", asked=asked, serves=serves,
            hint=f"to change the members of store {serves!r}, pass `--store {serves}` "
                 f"(`shmps-tool members {target} --store {serves} ...`); for store "
                 f"{asked!r}, ask one of its bridges")
    return auth.StoreMismatch(
        f"the bridge at {target} serves store {serves!r}, not {asked!r} (--store)",
        asked=asked, serves=serves,
        hint=f"to list the members of store {serves!r}, pass `--store {serves}` or no "
             f"--store; for store {asked!r}, ask one of its bridges")


def cmd_members(args: argparse.Namespace) -> int:
    from .bridge import auth   # (here: the other verbs start without the bridge's modules)
    from .bridge.members import normalize_address
    from .names import check_name
    target = normalize_address(args.bridge)
    if args.store is not None:
        check_name(args.store)
    if not args.add and not args.remove:
        status, _, body = _request(target, "GET", "/health", None, {}, args.timeout)
        if status != 200:
            raise Error(f"the bridge at {target} answered GET /health with {status}: "
                        f"{_error_of(body)}", hint="see its log")
        health = _json_object(target, "GET /health", body, ("members",))
        members = health["members"]
        # (each {"address": str, "state": str}, as Membership.snapshot writes them: any
        # other entry is no bridge's, and printing it failed as an internal error)
        if not isinstance(members, list) or not all(
                isinstance(m, dict) and isinstance(m.get("address"), str)
                and isinstance(m.get("state"), str) for m in members):
            raise Error(f"the answer of {target} to GET /health is not a bridge's (its "
                        "members are not a list of {\"address\": ..., \"state\": ...} "
                        "objects)", hint="is it shmps-bridge's --listen address, as "
                        "hosts.txt lists it?")
        # (/health is not signed: a check for the operator's sake, as a change's is not)
        if args.store is not None and health.get("store") != args.store:
            raise _wrong_store(target, args.store, str(health.get("store")), change=False)
        if args.json:
            print(json.dumps({"epoch": health.get("epoch"), "store": health.get("store"),
                              "members": health["members"]}))
        else:
            _print_health(target, health)
        return 0
    secret = auth.load_secret(args.secret_file) if args.secret_file else None
    if args.store is None:
        # (the request names the store, and a bridge of another one refuses it: the
        # operator says which store's members to change, so that a bridge of another
        # store, a port mistyped, is not changed instead)
        raise InvalidArgument(
            "--add and --remove need --store NAME: the store whose members to change (the "
            "bridges' --store); a bridge of another store refuses the change",
            hint=f"`shmps-tool members {target}` says which store that bridge serves; "
                 "pass it if that is the store you mean (`shmps-tool members "
                 f"{target} --store NAME {'--add' if args.add else '--remove'} "
                 "HOST:PORT ...`)")
    # (each address once: "--add X --add X" is one change, not "listed twice")
    change = {k: list(dict.fromkeys(normalize_address(a) for a in v))
              for k, v in (("add", args.add), ("remove", args.remove)) if v}
    body = json.dumps(change).encode()
    signed = auth.sign_request(secret, "POST", "/v1/members", body, CLIENT_ID, target=target,
                               store=args.store)
    status, headers, answer = _request(target, "POST", "/v1/members", body, signed,
                                       args.timeout)
    if status == 401:
        its = _loads(answer)   # (the bridge says its own address: the one its
        its = its.get("address") if isinstance(its, dict) else None   # signatures name)
        if isinstance(its, str) and its != target:
            raise auth.AuthError(f"the bridge at {target} refused the request's signature: "
                                 f"it is {its} in hosts.txt, and a signature names the "
                                 "address", hint=f"ask it as `shmps-tool members {its} ...`")
        raise auth.AuthError(
            f"the bridge at {target} refused the request's signature",
            hint=("pass --secret-file with the secret the bridges run with"
                  if secret is None else "check that --secret-file holds the secret the "
                  "bridges run with") + "; the bridge's log says what failed")
    if status in (200, 400, 409):
        # what the answer says counts only if that bridge said it (any process on the
        # address could answer, and one passing the request on could say "refused"); a
        # bridge of another store refuses with 409, and its answer's MAC covers its store
        try:
            auth.check_response(secret, signed, target, status, headers, answer)
        except auth.StoreMismatch as e:
            if status == 409:   # (refused before it did anything)
                raise _wrong_store(target, args.store, e.serves) from None
            # (a bridge that does not check the request's store: none of this release)
            raise auth.StoreMismatch(
                f"the bridge at {target} serves store {e.serves!r}, not {args.store!r} "
                f"(--store), and answered {status}: the change may have been applied there",
                asked=args.store, serves=e.serves,
                hint=f"look at its members with `shmps-tool members {target}`") from None
        except auth.AuthError as e:
            raise auth.AuthError(
                f"the answer from {target} ({status}) is not signed by a bridge holding "
                f"this secret ({e.message}): the change may or may not have been applied",
                hint=f"check which process listens on {target}, then look at the members "
                     f"with `shmps-tool members {target}`") from None
    if status == 400:
        raise InvalidArgument(f"the bridge at {target} refused the change: "
                              f"{_error_of(answer)}", hint="nothing was changed")
    if status != 200:
        raise Error(f"the bridge at {target} answered POST /v1/members with {status}: "
                    f"{_error_of(answer)}", hint="see its log; nothing may have changed")
    result = _json_object(target, "POST /v1/members", answer, ("members", "epoch"))
    already = result.get("already")
    if isinstance(already, list) and already:
        print(f"shmps-tool: {', '.join(map(str, already))}: a member already, nothing to add",
              file=sys.stderr)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"members now: {', '.join(map(str, result['members']))} (at {target}, which "
          f"sends the change on to every member)")
    # The answer's epoch is the one before the change takes effect: an added host owns
    # nothing until it has copied every shard, a removed one until it has handed its
    # shards over, and only then does the ring move to a new epoch.  Said so, the epoch
    # looked like the change's own (it was the one from before it).
    joining = [a for a in change.get("add", [])
               if not (isinstance(already, list) and a in already)]
    # (a removed member that was dead or never heard is dropped at once: the bridge
    # names it in "dropped"; the others hand their shards over first)
    dropped = result.get("dropped")
    dropped = [a for a in dropped if isinstance(a, str)] if isinstance(dropped, list) else []
    leaving = [a for a in change.get("remove", []) if a not in dropped]
    steps = ([f"{', '.join(joining)} {'has' if len(joining) == 1 else 'have'} copied every "
              "shard (its bridge must be running)"] if joining else [])
    steps += ([f"{', '.join(leaving)} {'has' if len(leaving) == 1 else 'have'} handed "
               "its shards over (its bridge exits)"] if leaving else [])
    gone = (f"{', '.join(dropped)} dropped at once (dead or never heard: "
            f"{'it owns' if len(dropped) == 1 else 'they own'} no shards to hand over)"
            if dropped else "")
    if steps:
        print(f"in flight: the ring is still that of epoch {result['epoch']}; it moves to "
              f"a new epoch once {' and '.join(steps)}; `shmps-tool members {target}` "
              "shows each member's state" + (f"; {gone}" if gone else ""))
    elif gone:
        print(f"epoch {result['epoch']}: {gone}")
    else:
        print(f"epoch {result['epoch']}: nothing changed")
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("members", help="show or change a running bridge's member list",
                       description="Show the members a running shmps-bridge sees, with "
                                   "their states; with --add / --remove, change the member "
                                   "list (POST /v1/members, signed for that bridge, applied "
                                   "by every member; not written to hosts.txt: edit it as "
                                   "well, or the next edit of it undoes the change).",
                       epilog="examples:\n  shmps-tool members 10.0.0.1:7070\n"
                              "  shmps-tool members 10.0.0.1:7070 --store model --add "
                              "10.0.0.4:7070 --secret-file secret",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bridge", metavar="HOST:PORT",
                   help="the bridge to ask: its --listen address, as hosts.txt lists it")
    p.add_argument("--add", action="append", default=[], metavar="HOST:PORT",
                   help="a host to add (repeat for several)")
    p.add_argument("--remove", action="append", default=[], metavar="HOST:PORT",
                   help="a member to remove (repeat for several); it hands its shards "
                        "over and its bridge exits")
    p.add_argument("--store", metavar="NAME",
                   help="the store whose members to change (the bridges' --store; needed "
                        "with --add / --remove: a bridge of another store refuses the "
                        "change); without them, checked against the bridge's")
    p.add_argument("--secret-file", metavar="F",
                   help="the cluster's shared secret (the bridges' --secret-file)")
    p.add_argument("--timeout", type=positive(MAX_SECONDS), default=10.0,
                   help="seconds to wait for the bridge's answer (default 10)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_members)


if __name__ == "__main__":  # pragma: no cover (run in a subprocess by the tests)
    # `python -m shmps.<this module> --help` printed nothing and exited 0: the module
    # only defines verbs of shmps-tool, so it runs shmps-tool
    from .cli import main
    raise SystemExit(main())
