"""Post an API-format prompt to a running ComfyUI and wait for it: python examples/post_prompt.py FILE [URL]."""
import json
import sys
import time
import urllib.error
import urllib.request
import uuid


def main():
    path = sys.argv[1]
    base = sys.argv[2] if len(sys.argv) > 2 else "http://127.0.0.1:8188"
    graph = json.load(open(path))
    req = urllib.request.Request(base + "/prompt", data=json.dumps({"prompt": graph, "client_id": str(uuid.uuid4())})
                                 .encode(), headers={"Content-Type": "application/json"})
    try:
        pid = json.load(urllib.request.urlopen(req))["prompt_id"]
    except urllib.error.HTTPError as e:
        sys.exit(f"ComfyUI refused the prompt ({e.code}): {e.read().decode()[:2000]}")
    t0 = time.perf_counter()
    while True:
        h = json.load(urllib.request.urlopen(f"{base}/history/{pid}"))
        if pid in h and h[pid].get("status", {}).get("completed") is not None:
            break
        time.sleep(0.5)
    status = h[pid]["status"]
    print(f"{status['status_str']} in {time.perf_counter() - t0:.1f} s")
    for m in status.get("messages", []):
        if m[0] == "execution_error":
            print(m[1].get("exception_message"))
    print(json.dumps(h[pid].get("outputs", {}))[:1000])
    sys.exit(0 if status["status_str"] == "success" else 1)


if __name__ == "__main__":
    main()
