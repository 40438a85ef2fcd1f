"""`tandem proxy --upstream URL ...`: one endpoint in front of several generation servers."""

import argparse

from tandem.cli.user_input import listen_options, user_error


def proxy_parser(sub) -> None:
    p = sub.add_parser(
        "proxy",
        help="one endpoint in front of several generation servers, routing by prompt prefix",
        description="Route rollouts to the replica holding their KV prefix; broadcast control calls and "
        "adapter loads (all-or-nothing) to every replica.",
    )
    p.add_argument(
        "--upstream",
        action="append",
        required=True,
        metavar="URL",
        help="a generation server's URL (repeat for each); on another machine, by its address there",
    )
    listen_options(p)
    _proxy_routing_and_upstream_options(p)


def _proxy_routing_and_upstream_options(p) -> None:
    """How the proxy routes (prefix blocks, imbalance), retries adapter loads and reaches its replicas."""
    p.add_argument(
        "--block-size", type=int, default=16, help="tokens per hashed prefix block, as the replicas' cache (default 16)"
    )
    p.add_argument(
        "--imbalance",
        type=int,
        default=8,
        help="affinity only while the replica has at most this many more "
        "requests in flight than the least loaded (default 8)",
    )
    p.add_argument(
        "--lora-retry-s", type=float, default=2.0, help="wait between retries of 'No adapter found' (default 2)"
    )
    p.add_argument(
        "--lora-load-timeout-s", type=float, default=300.0, help="give up on a lagging replica after this (default 300)"
    )
    p.add_argument(
        "--connect-timeout-s",
        type=float,
        default=10.0,
        help="a replica that does not accept within this is down (default 10)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1, /v2, /inference, /cohere, as vLLM does",
    )
    p.add_argument("--upstream-api-key", default=None, help="bearer token sent to the replicas")
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="route chat requests by their rendered token ids, as the replicas cache them (default: by their text)",
    )
    p.add_argument(
        "--stats-interval-s",
        type=float,
        default=60.0,
        help="print '[proxy] stats {json}' (per-replica load, router counts) this often; 0 = never (default 60)",
    )
    p.add_argument(
        "--probe-interval-s",
        type=float,
        default=1.0,
        help="ask a down replica's /health this often; once it answers it is caught up, then routed to (default 1)",
    )


def run_proxy(ns: argparse.Namespace) -> None:
    from tandem.httpapp import run_until_interrupted
    from tandem.proxy.app import ProxyArgs, start_proxy

    args = ProxyArgs(
        upstreams=ns.upstream,
        host=ns.host,
        port=ns.port,
        block_size=ns.block_size,
        imbalance=ns.imbalance,
        lora_retry_s=ns.lora_retry_s,
        lora_load_timeout_s=ns.lora_load_timeout_s,
        connect_timeout_s=ns.connect_timeout_s,
        api_key=ns.api_key,
        upstream_api_key=ns.upstream_api_key,
        tokenizer=ns.tokenizer,
        stats_interval_s=ns.stats_interval_s,
        probe_interval_s=ns.probe_interval_s,
    )
    if not args.probe_interval_s > 0:
        user_error(f"tandem proxy: --probe-interval-s {args.probe_interval_s:g}: must be a positive number of seconds")
    run_until_interrupted(
        start_proxy(args), lambda port: f"tandem proxy: http://{args.host}:{port} -> {', '.join(args.upstreams)}"
    )
