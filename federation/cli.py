"""`fedctl`: run and inspect a federation.

fedctl up [--config FILE] [--port 8080] [--speed X]   the embedded default, or FILE's
fedctl status [--json] [--scheduler HOST:PORT]         the sites as the schedulers see them
fedctl status --watch [--interval-s 1] [--json]        the same, refreshed as the schedulers push it, until Ctrl-C
fedctl dashboard [--port 8070] [--gateway URL]         the federation live in a browser (http://127.0.0.1:8070)
fedctl site drain|undrain|remove NAME                  stop new work at a site, resume it, drop it
fedctl site add --name N --region R --gpu G --gpus N --emulate   a new site joins `fedctl up`
fedctl site add --name N --region R --gpu G --gpus N --agent HOST:PORT   a running agent joins
fedctl bench [--scenario offline|server] [--json FILE]  throughput and latency (fedctl bench -h)
fedctl drill SCENARIO [--json FILE] [--png FILE]       a fault under load (fedctl drill -h)
fedctl ca init | ca issue --site NAME | --role ROLE    the federation's CA and certificates (mutual TLS)
fedctl keys add NAME [--rpm N] [--tpm N] [--max-concurrent N]   an API key for the gateway, printed once
fedctl keys list | set NAME --tpm N | revoke NAME      the keys file's (--file) or every region's store's (--redis R=URL)
fedctl fuzz [--http N] [--grpc N] [--json FILE]        generated hostile requests while valid traffic flows
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import json
import queue
import signal
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import pydantic

from core import credential, mtls, pki, runtime, wire
from core.config import ConfigError, SiteConfig, load
from core.gpus import PROFILES
from core.policy import POLICIES
from core.processes import PortRangeError, StartFailed, free_port_block, port_range
from core.settings import describe
from core.tiers import Tier
from federation import admin, check, control, status_view, watch
from federation.throwaway_ca import operator_tls

if TYPE_CHECKING:
    from federation.embedded import Federation

# The commands that start their own federation and load it (bench, drill, fuzz): their modules
# bring load generators, plots and hypothesis (slow to import), so each is imported, and its
# arguments defined, only when it is the command given; `fedctl status` and the other short
# commands, which tests and drills run dozens of times, start without them.
MEASURES = {
    "bench": ("federation.bench.run", "measure the federation, its sites alone and the peers"),
    "drill": ("federation.drills.run", "inject a fault under load and measure what it cost"),
    "fuzz": ("federation.fuzz", "send generated hostile requests while valid traffic flows"),
    "simulate": ("federation.simulate.run", "the control plane and the routing policy at scale, simulated"),
}

# What those commands import from the `tools` extra (pyproject.toml), which the runtime processes
# and `fedctl up` never need: without it they stop before they start anything.
TOOLS_EXTRA = "inference-federation[tools]"
TOOL_MODULES = ("hypothesis", "matplotlib", "mlperf_loadgen", "sglang_router", "tqdm")

CA_DIR = Path("federation-ca")  # `fedctl ca`'s directory unless --dir says another
KEYS_FILE = Path("federation-keys.json")  # `fedctl keys`' file unless --file says another
TIERS = [t.label for t in Tier]  # the service tiers a key may be given (core/tiers.py)
SET_NEEDS = "fedctl keys set: give --rpm, --tpm, --max-concurrent, --default-tier or --max-tier"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="fedctl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start a federation and serve until Ctrl-C")
    up.add_argument("--config", type=Path, default=None, help="YAML: regions, RTTs, sites, ports")
    up.add_argument("--port", type=int, default=None, help="the gateway's port (default 8080)")
    up.add_argument("--speed", type=runtime.positive_float, default=None, help="emulated GPU speed (0.1 = 10x slower)")
    up.add_argument(
        "--policy", choices=sorted(POLICIES), default=None, help="routing policy (baselines for comparison)"
    )
    up.add_argument(
        "--insecure",
        action="store_true",
        help="plaintext gRPC between its processes (default: mutual TLS under a CA made for the run)",
    )
    up.add_argument(
        "--launch",
        action="store_true",
        help="each site's agent launches one emulated SGLang server per GPU from its recipe, as a real site "
        "launches SGLang (default: one emulator process per site serves all its GPUs)",
    )
    up.add_argument(
        "--join-token-file",
        type=Path,
        default=None,
        help="(--insecure) the join credential its sites present, in a file of mode 0600 (default: one made for "
        "the run)",
    )
    check = sub.add_parser(
        "check", help="check a deployment's config file: keys, ports, links, recipes, certificates, API keys"
    )
    check.add_argument(
        "--config", type=Path, default=None, help="the file (default: $FEDERATION_CONFIG, else the built-in)"
    )
    status = sub.add_parser("status", help="list the sites")
    status.add_argument("--json", action="store_true", help="a JSON object (with --watch: one per line, per update)")
    status.add_argument("--watch", action="store_true", help="refresh as the schedulers push their state, until Ctrl-C")
    status.add_argument(
        "--interval-s", type=runtime.positive_float, default=1.0, help="(--watch) how often the state is pushed"
    )
    _add_target(status)
    board = sub.add_parser("dashboard", help="serve a live web page of the federation (sites, shares, tokens/s)")
    board.add_argument("--port", type=runtime.non_negative_int, default=8070, help="its port (0: any free one)")
    board.add_argument(
        "--bind", default="127.0.0.1", help="the address it listens on (default: this machine only; others are warned)"
    )
    board.add_argument(
        "--gateway", metavar="URL", default=None, help="the gateway whose /metrics it scrapes (default: the config's)"
    )
    _add_target(board)
    site = sub.add_parser("site", help="add, drain, undrain or remove a site").add_subparsers(
        dest="action", required=True
    )
    drain = site.add_parser("drain", help="no new work; wait until what it has is finished")
    drain.add_argument("name")
    drain.add_argument("--no-wait", action="store_true", help="return once every replica has it draining")
    drain.add_argument("--timeout-s", type=runtime.positive_float, default=3600.0, help="give up waiting after this")
    for action, text in (("undrain", "let new work go to the site again"), ("remove", "forget the site")):
        site.add_parser(action, help=text).add_argument("name")
    add = site.add_parser("add", help="a new site joins the running federation (`fedctl up`)")
    add.add_argument("--name", required=True)
    add.add_argument("--region", required=True)
    add.add_argument("--gpu", required=True, choices=sorted(PROFILES))
    add.add_argument("--gpus", type=runtime.positive_int, required=True)
    how = add.add_mutually_exclusive_group(required=True)
    how.add_argument("--emulate", action="store_true", help="emulated workers, started by the running `fedctl up`")
    how.add_argument(
        "--agent",
        metavar="HOST:PORT",
        help="an agent already running without schedulers: it joins them (in a plaintext federation, presenting "
        "the credential in --join-token-file)",
    )
    add.add_argument(
        "--join-token-file",
        type=Path,
        default=None,
        help="(--agent, --insecure) the federation's join credential, mode 0600 (default: the one the "
        "`fedctl up --insecure` of this config made)",
    )
    add.add_argument("--timeout-s", type=runtime.positive_float, default=120.0, help="(--agent) wait this long")
    for parser in site.choices.values():
        _add_target(parser)
    ca = sub.add_parser("ca", help="the federation's certificate authority").add_subparsers(
        dest="action", required=True
    )
    ca.add_parser("init", help="make a new CA").add_argument("--dir", type=Path, default=CA_DIR)
    issue = ca.add_parser("issue", help="a certificate and key for a site, a gateway, a scheduler or an operator")
    who = issue.add_mutually_exclusive_group(required=True)
    who.add_argument("--site", help="a site's agent, which may act as this site only")
    who.add_argument("--role", choices=[r.value for r in pki.Role if r is not pki.Role.SITE])
    issue.add_argument("--host", action="append", default=[], help="a name or address it serves at, repeatable")
    issue.add_argument("--dir", type=Path, default=CA_DIR, help="the CA's directory")
    issue.add_argument("--out", type=Path, default=None, help="where to write it (default: the CA's directory)")
    keys = sub.add_parser("keys", help="the gateway's API keys").add_subparsers(dest="action", required=True)
    add_key = keys.add_parser("add", help="make a key (printed once; only its hash is kept) with its limits")
    add_key.add_argument("name", help="names the key in metrics and logs")
    add_key.add_argument(
        "--home",
        default="",
        help="with --redis: the region whose store holds the key's budget (default: the first given)",
    )
    set_key = keys.add_parser("set", help="change a key's limits (those given; 0: no limit)")
    set_key.add_argument("name")
    for parser, kind in ((add_key, runtime.positive_int), (set_key, runtime.non_negative_int)):
        default = 0 if parser is add_key else None
        parser.add_argument("--rpm", type=kind, default=default, help="requests per minute (default: no limit)")
        parser.add_argument("--tpm", type=kind, default=default, help="prompt + output tokens per minute")
        parser.add_argument("--max-concurrent", type=kind, default=default, help="requests at once")
        parser.add_argument(
            "--default-tier",
            choices=TIERS,
            default=None,
            help="the service tier of its requests that ask `auto` or none (default: default)",
        )
        parser.add_argument(
            "--max-tier",
            choices=TIERS,
            default=None,
            help="the highest service tier it may ask for (default: default; priority must be allowed)",
        )
    keys.add_parser("revoke", help="refuse a key from now on (every gateway within a second)").add_argument("name")
    keys.add_parser("list", help="the keys' names, limits and homes (never the keys)")
    for parser in keys.choices.values():
        store = parser.add_mutually_exclusive_group()
        store.add_argument("--file", type=Path, default=KEYS_FILE, help=f"the keys file (default {KEYS_FILE})")
        store.add_argument(
            "--redis",
            action="append",
            metavar="REGION=URL",
            help="a region's quota store (REGION=redis://HOST:PORT/DB), repeatable: every one given is written "
            "(docs/QUOTAS.md)",
        )
    given = next((a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")), None)
    for command, (module, text) in MEASURES.items():
        measure = sub.add_parser(command, help=text)
        if command == given:  # see MEASURES
            _need_tools(command)
            importlib.import_module(module).add_arguments(measure)
    return p.parse_args(argv)


def _need_tools(command: str) -> None:
    """Exit 2, saying which extra to install, when the tools' packages are not installed."""
    missing = [m for m in TOOL_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        print(
            f"fedctl {command}: needs the tools extra ({', '.join(missing)} not installed): "
            f"pip install '{TOOLS_EXTRA}' (from a checkout: pip install -e '.[tools]')",
            file=sys.stderr,
        )
        raise SystemExit(2)


def _add_target(p: argparse.ArgumentParser) -> None:
    """Where an operator command goes, and the operator's certificate it presents (default: the
    one the `fedctl up` of this config on this machine made)."""
    p.add_argument("--config", type=Path, default=None)
    p.add_argument(
        "--scheduler", action="append", default=None, help="host:port of a replica, repeatable (default: the config's)"
    )
    mtls.add_arguments(p, "operator")


def _operator(args: argparse.Namespace) -> mtls.Tls:
    """The operator's credentials: the flags', else those the `fedctl up` of this config keeps."""
    if mtls.given(args):
        return mtls.tls_from(args, pki.OPERATOR)
    directory = control.tls_dir(load(args.config))
    found = operator_tls(directory)
    if found is None:
        raise pki.PkiError(
            f"no operator certificate: no `fedctl up` of this config keeps one in {directory}; give --ca, --cert "
            "and --key (fedctl ca issue --role operator), or --insecure for a federation started --insecure"
        )
    return found


def _schedulers(args: argparse.Namespace) -> list[str]:
    return args.scheduler or list(load(args.config).scheduler_addresses)


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


_NEXT_STEPS = """try next:
  curl -s {endpoint}/chat/completions -H 'content-type: application/json' \\
    -d '{{"model": "openai/gpt-oss-120b", "messages": [{{"role": "user", "content": "Hello"}}]}}'
  fedctl status --watch          # the sites, their measured capacity and load, live
  fedctl dashboard               # the same in a browser, at http://127.0.0.1:8070"""


def cmd_up(args: argparse.Namespace) -> int:
    from federation.embedded import Federation  # here: the gateway's and agents' modules, not needed by the others

    config = load(args.config).with_overrides(port=args.port, speed=args.speed, policy=args.policy)
    token = credential.read_secret(args.join_token_file) if args.join_token_file else ""
    federation = Federation(config, insecure=args.insecure, join_token=token, launch=args.launch)
    jobs: queue.Queue = queue.Queue()
    controls = control.ControlServer(control.socket_path(config), _site_controls(federation, jobs))
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM stops us like Ctrl-C, even mid start-up
    try:
        federation.up()
        controls.start()
        endpoint = config.gateway_url + "/v1"
        runtime.announce_ready(endpoint=endpoint, sites=[s.name for s in config.sites], speed=config.speed)
        print(
            f"federation ready: {endpoint}  (Ctrl-C stops it)\n{_NEXT_STEPS.format(endpoint=endpoint)}",
            file=sys.stderr,
            flush=True,
        )
        if federation.ca is not None:
            where = federation.ca.directory
            print(f"gRPC: mutual TLS under a CA made for this run, in {where}", file=sys.stderr, flush=True)
        reported: set[str] = set()
        while True:
            _run_pending(jobs, wait_s=0.5)
            dead = {c.name for c in federation.children if not c.alive()}
            for name in sorted(dead - reported):  # a site or a scheduler replica may die: the rest serve on
                print(f"fedctl: {name} exited; the federation serves on without it", file=sys.stderr, flush=True)
            reported = dead
            gateways = [c.name for c in federation.children if c.name.startswith("gateway")]
            if all(name in dead for name in gateways):
                print("fedctl: the gateway exited; stopping the federation", file=sys.stderr)
                return 1
    except KeyboardInterrupt:
        return 0
    except StartFailed as exc:
        print(f"fedctl: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        controls.stop()
        federation.down()


def _site_controls(federation: Federation, jobs: queue.Queue) -> control.Handler:
    """What `fedctl up` does when `fedctl site add --emulate` or `fedctl site remove` asks. The
    work is done by the main thread (`_run_pending`): a child is told to die with the thread that
    started it, and this handler's thread ends with the connection."""

    def add(spec: object) -> Callable[[], dict] | dict:
        if not isinstance(spec, dict):
            return {"error": f"a site to add must be an object, not {spec!r}"}
        try:
            fields = {key: spec[key] for key in ("name", "region", "gpu", "gpus")}
            site = SiteConfig(**fields, agent_port=free_port_block(1))
        except KeyError as exc:
            return {"error": f"a site needs name, region, gpu and gpus: {exc} is missing"}
        except pydantic.ValidationError as exc:
            return {"error": describe(exc, "the site")}
        if not site.name:
            return {"error": f"a site needs a name, a GPU ({', '.join(sorted(PROFILES))}) and at least 1 GPU"}

        def start() -> dict:
            federation.add_site(site)
            return {"site": site.name, "agent": f"{federation.config.host}:{site.agent_port}"}

        return start

    def remove(name: object) -> Callable[[], dict]:
        return lambda: {"site": name, "stopped": federation.remove_site(str(name))}

    def handle(request: dict) -> dict:
        command = request.get("command")
        if command == "add_site":
            job = add(request.get("site"))
        elif command == "remove_site":
            job = remove(request.get("name"))
        else:
            return {"error": f"unknown request {request!r}"}
        if isinstance(job, dict):
            return job
        done: Future[dict] = Future()
        jobs.put((job, done))
        return done.result()

    return handle


def _run_pending(jobs: queue.Queue, wait_s: float) -> None:
    """Do what the control socket asked for (waiting up to `wait_s` for a request)."""
    try:
        job, done = jobs.get(timeout=wait_s)
    except queue.Empty:
        return
    try:
        done.set_result(job())
    except (ValueError, StartFailed) as exc:
        done.set_result({"error": str(exc)})


def cmd_check(args: argparse.Namespace) -> int:
    """0 and a line saying what the file describes, or 2 and one line per fault."""
    config, found = check.faults(args.config)
    for fault in found:
        print(f"fedctl check: {fault}", file=sys.stderr)
    if config is None or found:
        return 2
    print(f"{args.config or 'the built-in default'}: ok: {check.summary(config)}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    config = load(args.config)
    addresses = args.scheduler or list(config.scheduler_addresses)
    if args.watch:
        return _watch_status(args, addresses, config.gateway_url)
    state, replicas = admin.replicas_state(addresses, _operator(args))
    if state is None:
        gateway = admin.gateway_health(config.gateway_url)
        for line in status_view.unreachable_lines(addresses, gateway):
            print(f"fedctl: {line}", file=sys.stderr)
        if args.json:
            print(json.dumps(status_view.unreachable_body(replicas, gateway), indent=2))
        return 1
    gateway_metrics = admin.gateway_metrics(config.gateway_url)
    if args.json:
        print(json.dumps(status_view.state_body(state, replicas, gateway_metrics), indent=2))
        return 0
    print(status_view.state_table(state, replicas, gateway_metrics))
    return 0


def _watch_status(args: argparse.Namespace, addresses: list[str], gateway_url: str) -> int:
    """`fedctl status --watch`: every state the watched replica pushes, until Ctrl-C (exit 0)."""
    operator = _operator(args)
    try:
        asyncio.run(_print_updates(args, addresses, operator, gateway_url))
    except admin.Refused as exc:
        print(f"fedctl: refused: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass  # Ctrl-C is how a watch ends
    return 0


async def _print_updates(args: argparse.Namespace, addresses: list[str], operator: mtls.Tls, gateway_url: str) -> None:
    terminal, first = sys.stdout.isatty(), True
    async for update in watch.updates(addresses, operator, args.interval_s):
        at_unix_s = time.time()
        gateway = {} if update.state else await asyncio.to_thread(admin.gateway_health, gateway_url)
        metrics = await asyncio.to_thread(admin.gateway_metrics, gateway_url) if update.state else None
        if args.json:
            body = (
                status_view.state_body(update.state, update.replicas, metrics)
                if update.state
                else status_view.unreachable_body(update.replicas, gateway)
            )
            print(json.dumps({"at_unix_s": round(at_unix_s, 3), **body}), flush=True)
            continue
        text = (
            status_view.state_table(update.state, update.replicas, metrics)
            if update.state
            else "\n".join(
                [*status_view.unreachable_lines(addresses, gateway), status_view.schedulers_line(update.replicas)]
            )
        )
        print(status_view.frame(text, at_unix_s, terminal, first), flush=True)
        first = False


def cmd_dashboard(args: argparse.Namespace) -> int:
    """Serve the page until Ctrl-C; it watches the schedulers `fedctl status` asks, with the
    same operator certificate."""
    from federation.dashboard import server as dashboard  # here: aiohttp's server, needed by this command only

    config = load(args.config)
    gateway = (args.gateway or config.gateway_url).rstrip("/").removesuffix("/metrics").removesuffix("/v1")
    settings = dashboard.DashboardConfig(
        config, tuple(_schedulers(args)), _operator(args), gateway, args.bind, args.port
    )
    return dashboard.main(settings)


def cmd_site_add(args: argparse.Namespace) -> int:
    """--emulate: ask the running `fedctl up` of this config to start the site; it answers once
    the site is ready at every scheduler replica. --agent: tell that agent to join the
    schedulers, then wait until every replica has it ready, or one refuses it."""
    if args.agent:
        return _join_agent(args)
    config = load(args.config)
    site = {"name": args.name, "region": args.region, "gpu": args.gpu, "gpus": args.gpus}
    try:
        reply = control.request(control.socket_path(config), {"command": "add_site", "site": site})
    except control.NotRunning as exc:
        print(f"fedctl: {exc}: start the federation with `fedctl up` first", file=sys.stderr)
        return 1
    if "error" in reply:
        print(f"fedctl: {args.name} not added: {reply['error']}", file=sys.stderr)
        return 2
    print(f"{args.name}: joined, agent at {reply['agent']}; its share grows as it proves its capacity")
    return 0


def _join_credential(args: argparse.Namespace) -> str:
    """What `fedctl site add --agent` presents to a plaintext agent: --join-token-file's, else
    the credential the `fedctl up --insecure` of this config keeps, else none."""
    if args.join_token_file is not None:
        return credential.read_secret(args.join_token_file)
    path = control.join_token_path(load(args.config))
    return credential.read_secret(path) if path.exists() else ""


def _join_agent(args: argparse.Namespace) -> int:
    schedulers, operator = _schedulers(args), _operator(args)
    request = wire.JoinRequest(tuple(schedulers), args.name, args.region, args.gpu, args.gpus)
    asked_at = time.time()
    try:
        address = admin.join_agent(args.agent, operator, request, _join_credential(args))
    except grpc.RpcError as exc:
        hint = (
            " (give --join-token-file the federation's credential)"
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED
            else ""
        )
        print(
            f"fedctl: the agent at {args.agent} did not join: {exc.details() or exc.code().name}{hint}", file=sys.stderr
        )
        return 2
    try:
        refusal = admin.wait_joined(schedulers, operator, args.name, asked_at, args.timeout_s)
    except TimeoutError as exc:
        print(f"fedctl: {exc}; `fedctl status` shows where it stands", file=sys.stderr)
        return 1
    if refusal is not None:
        print(f"fedctl: {args.name} refused: {refusal}", file=sys.stderr)
        return 2
    print(f"{args.name}: joined, agent at {address}; its share grows as it proves its capacity")
    return 0


def _stop_site_processes(args: argparse.Namespace) -> None:
    """A site removed from the federation `fedctl up` runs here: its processes stop too. Any
    other site (a real one, or another federation's) is its operator's to stop."""
    try:
        reply = control.request(control.socket_path(load(args.config)), {"command": "remove_site", "name": args.name})
    except control.NotRunning:
        return
    if reply.get("stopped"):
        print(f"{args.name}: stopped {', '.join(reply['stopped'])}")


def cmd_site(args: argparse.Namespace) -> int:
    if args.action == "add":
        return cmd_site_add(args)
    addresses, operator = _schedulers(args), _operator(args)
    try:
        if args.action == "remove":
            done = admin.remove(addresses, operator, args.name)
            print(f"{args.name}: removed at {', '.join(done)}")
            _stop_site_processes(args)
            return 0
        done = admin.drain(addresses, operator, args.name, draining=args.action == "drain")
        print(f"{args.name}: {'draining' if args.action == 'drain' else 'taking new work'} at {', '.join(done)}")
        if args.action == "undrain" or args.no_wait:
            return 0

        def show(in_flight: int) -> None:
            print(f"{args.name}: {in_flight} requests in flight", file=sys.stderr, flush=True)

        if admin.wait_empty(addresses, operator, args.name, args.timeout_s, show):
            print(f"{args.name}: drained, no request in flight")
            return 0
        print(f"fedctl: {args.name} still has requests in flight after {args.timeout_s:.0f} s", file=sys.stderr)
        return 1
    except LookupError as exc:
        print(f"fedctl: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2
    except admin.Refused as exc:
        print(f"fedctl: refused: {exc}", file=sys.stderr)
        return 2
    except admin.NoReplica as exc:
        print(f"fedctl: {exc}", file=sys.stderr)
        return 1


def cmd_ca(args: argparse.Namespace) -> int:
    try:
        if args.action == "init":
            pki.init_ca(args.dir)
            print(f"CA made in {args.dir} (its key, {pki.CA_KEY}, is readable by you only: keep it off the sites)")
            return 0
        identity = pki.Identity(pki.Role.SITE, args.site) if args.site else pki.Identity(pki.Role(args.role))
        cert, key = pki.issue(args.dir, identity, args.out or args.dir, tuple(args.host))
    except pki.PkiError as exc:
        print(f"fedctl ca: {exc}", file=sys.stderr)
        return 2
    print(f"{identity}: {cert} and {key} (with {args.dir / pki.CA_CERT}); it answers as {identity.server_name}")
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    from federation.gateway import keys, keystore  # here: the gateway's package, needed by this command only

    try:
        if args.redis:
            return _keys_in_stores(args, keystore.stores(args.redis))
        return _keys_in_file(args)
    except keys.KeyFileError as exc:
        print(f"fedctl keys: {exc}", file=sys.stderr)
        return 2
    except keystore.StoreError as exc:
        print(f"fedctl keys: {exc}", file=sys.stderr)
        return 1


def _limit_changes(args: argparse.Namespace) -> dict[str, int | str]:
    names = ("rpm", "tpm", "max_concurrent", "default_tier", "max_tier")
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def _print_keys(table: dict[str, Any]) -> None:
    print(f"{'name':<24} {'rpm':>8} {'tpm':>10} {'concurrent':>10}  {'tiers':<18} home")
    for name, k in table.items():
        tiers = f"{k.default_tier} (<= {k.max_tier})"
        home = getattr(k, "home", "") or "-"
        print(f"{name:<24} {k.rpm:>8} {k.tpm:>10} {k.max_concurrent:>10}  {tiers:<18} {home}")


def _keys_in_file(args: argparse.Namespace) -> int:
    from federation.gateway import keys

    if args.action == "add":
        limits = keys.changed(keys.KeyLimits(), _limit_changes(args))
        print(keys.add(args.file, args.name, limits))
        print(
            f"fedctl keys: {args.name} added to {args.file} (only its hash is kept: this is the one time it is shown)",
            file=sys.stderr,
        )
    elif args.action == "list":
        _print_keys(dict(keys.listed(args.file)))
    elif args.action == "revoke":
        keys.revoke(args.file, args.name)
        print(f"fedctl keys: {args.name} revoked in {args.file}", file=sys.stderr)
    else:
        if not _limit_changes(args):
            print(SET_NEEDS, file=sys.stderr)
            return 2
        entry = keys.set_limits(args.file, args.name, _limit_changes(args))
        _print_keys({args.name: entry})
    return 0


def _keys_in_stores(args: argparse.Namespace, stores: dict[str, Any]) -> int:
    from federation.gateway import keys, keystore

    if args.action == "add":
        limits = keys.changed(keys.KeyLimits(), _limit_changes(args))
        key = keystore.add(stores, args.name, limits, args.home or next(iter(stores)))
        print(key)
        print(
            f"fedctl keys: {args.name} added to {len(stores)} store(s) (only its hash is kept: this is the one time "
            "it is shown)",
            file=sys.stderr,
        )
    elif args.action == "list":
        _print_keys(dict(keystore.listed(stores)))
    elif args.action == "revoke":
        keystore.revoke(stores, args.name)
        print(f"fedctl keys: {args.name} revoked in {len(stores)} store(s)", file=sys.stderr)
    else:
        if not _limit_changes(args):
            print(SET_NEEDS, file=sys.stderr)
            return 2
        _print_keys({args.name: keystore.set_limits(stores, args.name, _limit_changes(args))})
    return 0


def cmd_measure(args: argparse.Namespace) -> int:
    """bench, drill, fuzz and simulate: long runs of their own."""
    signal.signal(signal.SIGTERM, _interrupt)  # stop like Ctrl-C: every process the run started stops too
    try:
        return importlib.import_module(MEASURES[args.command][0]).main(args)
    except KeyboardInterrupt:
        print(f"fedctl {args.command}: interrupted", file=sys.stderr)
        return 130
    except StartFailed as exc:
        print(f"fedctl {args.command}: {exc}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        port_range()  # a bad FEDERATION_PORT_RANGE is said before anything starts
        if args.command in MEASURES:
            return cmd_measure(args)
        if args.command == "site":
            return cmd_site(args)
        if args.command == "ca":
            return cmd_ca(args)
        if args.command == "keys":
            return cmd_keys(args)
        if args.command == "dashboard":
            return cmd_dashboard(args)
        if args.command == "check":
            return cmd_check(args)
        return cmd_up(args) if args.command == "up" else cmd_status(args)
    except (ConfigError, pki.PkiError, credential.SecretFileError, PortRangeError) as exc:
        print(f"fedctl: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
