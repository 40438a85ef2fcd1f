"""A local stand-in of the Hugging Face Hub's upload routes (create a repo, a branch, preupload, commit), enough for
huggingface_hub's create_repo / create_branch / upload_folder: point HF_ENDPOINT at `url` and read what arrived in
`files`. It can be told to fail the next commits, as a flaky network would."""

import asyncio
import base64
import json
import threading

from aiohttp import web


class HubStandIn:
    def __init__(self):
        self.files: dict[tuple[str, str, str], bytes] = {}
        """(repo id, revision, path in the repo) -> the file's bytes, as committed."""
        self.repos: dict[str, dict] = {}
        """repo id -> what create_repo asked for (its visibility)."""
        self.branches: set[tuple[str, str]] = set()
        self.commits: list[tuple[str, str, str]] = []
        """(repo id, revision, message) of every commit that succeeded."""
        self.tokens: set[str] = set()
        self.fail_commits = 0
        self.commit_delay_s = 0.0
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        threading.Thread(target=self._serve, args=(ready,), daemon=True).start()
        ready.wait(10)

    def _serve(self, ready: threading.Event) -> None:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_post("/api/repos/create", self.create_repo)
        app.router.add_post("/api/models/{namespace}/{name}/branch/{branch}", self.create_branch)
        app.router.add_post("/api/models/{namespace}/{name}/preupload/{revision}", self.preupload)
        app.router.add_post("/api/models/{namespace}/{name}/commit/{revision}", self.commit)
        runner = web.AppRunner(app)
        self.loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        ready.set()
        self.loop.run_forever()

    def _auth(self, request: web.Request) -> None:
        self.tokens.add(request.headers.get("authorization", "").removeprefix("Bearer "))

    async def create_repo(self, request: web.Request) -> web.Response:
        self._auth(request)
        body = await request.json()
        repo = f"{body.get('organization') or 'me'}/{body['name']}"
        self.repos[repo] = body
        return web.json_response({"url": f"{self.url}/{repo}", "name": repo})

    async def create_branch(self, request: web.Request) -> web.Response:
        self._auth(request)
        self.branches.add(
            (f"{request.match_info['namespace']}/{request.match_info['name']}", request.match_info["branch"])
        )
        return web.json_response({})

    async def preupload(self, request: web.Request) -> web.Response:
        body = await request.json()  # every file uploaded inline ("regular"): no LFS server needed
        return web.json_response(
            {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in body["files"]]}
        )

    async def commit(self, request: web.Request) -> web.Response:
        self._auth(request)
        if self.fail_commits:
            self.fail_commits -= 1
            return web.json_response(
                {"error": "stand-in: refused for now"}, status=403
            )  # huggingface_hub retries 5xx itself
        await asyncio.sleep(self.commit_delay_s)
        repo, revision = (
            f"{request.match_info['namespace']}/{request.match_info['name']}",
            request.match_info["revision"],
        )
        message = ""
        for line in (await request.read()).decode().splitlines():
            item = json.loads(line)
            if item["key"] == "header":
                message = item["value"]["summary"]
            elif item["key"] == "file":
                self.files[(repo, revision, item["value"]["path"])] = base64.b64decode(item["value"]["content"])
        self.commits.append((repo, revision, message))
        return web.json_response({"commitUrl": f"{self.url}/{repo}/commit/{'a' * 40}", "commitOid": "a" * 40})

    def paths(self, repo: str, revision: str) -> set[str]:
        return {path for (r, rev, path) in self.files if (r, rev) == (repo, revision)}
