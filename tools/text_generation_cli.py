"""Interactive client of the REST server (Megatron's `tools/text_generation_cli.py`).

    python tools/text_generation_cli.py 127.0.0.1:5000

Reads a prompt and a token count, sends `PUT /api` with `{"prompts": [prompt], "tokens_to_generate": n}` and prints
`text[0]` of the answer (or the server's error message).
"""
import json
import sys
import urllib.error
import urllib.request


def generate(url: str, prompt: str, tokens_to_generate: int) -> str:
    """The generated text of one prompt (the server's error message on a 4xx/5xx)."""
    data = json.dumps({"prompts": [prompt], "tokens_to_generate": tokens_to_generate}).encode("utf-8")
    request = urllib.request.Request(f"http://{url}/api", data=data, method="PUT",
                                     headers={"Content-Type": "application/json; charset=UTF-8"})
    try:
        with urllib.request.urlopen(request) as response:
            return json.loads(response.read())["text"][0]
    except urllib.error.HTTPError as error:
        body = json.loads(error.read() or b"{}")
        return f"error {error.code}: {body.get('error', {}).get('message', body)}"


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: python tools/text_generation_cli.py HOST:PORT")
    url = sys.argv[1]
    while True:
        try:
            prompt = input("Enter prompt: ")
            count = int(input("Enter number of tokens to generate: "))
        except (EOFError, KeyboardInterrupt):
            return
        except ValueError:
            print("the number of tokens must be an integer")
            continue
        print(f"Megatron Response: {generate(url, prompt, count)}")


if __name__ == "__main__":
    main()
