"""`kvforge chat`'s loop: a conversation on a terminal over a session's stream_chat (runtime/session.py)."""

from __future__ import annotations

from kvforge.errors import KvforgeError


def run_chat(session, opening: list[dict], options: dict) -> None:
    """The chat loop over stdin and stdout (bounded by its input: it ends at EOF or /exit). Each line is a user
    message and its reply streams back; /reset starts over; Ctrl-C stops a reply and keeps the conversation."""
    messages = list(opening)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(flush=True)
            return
        except KeyboardInterrupt:  # at the prompt: a fresh line, the conversation kept
            print(flush=True)
            continue
        if line.strip() in ("/exit", "/quit"):
            return
        if line.strip() == "/reset":
            messages = list(opening)
            print("(conversation reset)", flush=True)
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        reply = []
        try:
            for event in session.stream_chat(messages, **options):
                reply.append(event.text)
                print(event.text, end="", flush=True)
        except KeyboardInterrupt:
            print(" [stopped]", end="", flush=True)
        except KvforgeError as e:  # a conversation past the context: say so, keep the program
            messages.pop()
            print(f"error: {' '.join(str(e).split())} (/reset starts over)", flush=True)
            continue
        print(flush=True)
        messages.append({"role": "assistant", "content": "".join(reply)})
