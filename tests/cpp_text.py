"""C++ source as text for the repository's lint scripts (rank_thread_lint.py, layering_lint.py)."""
import re


def blank_comments_and_strings(src: str) -> str:
    """Blanks comments and string/char literals, raw strings included; newlines and the quote
    characters are kept, so line numbers and offsets hold. A ' after a digit or letter is a
    digit separator (1'000), not a literal."""
    out, i, n = [], 0, len(src)
    while i < n:
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", src[i:j]))
            i = j
        elif src[i] == '"' and src[i - 1:i] == "R":  # raw string R"d(...)d"
            k = src.find("(", i + 1)
            end = ")" + src[i + 1:k] + '"'
            j = src.find(end, k)
            j = n - 1 if j < 0 else j + len(end) - 1
            out.append('"' + re.sub(r"[^\n]", " ", src[i + 1:j]) + '"')
            i = j + 1
        elif src[i] == '"' or (src[i] == "'" and not src[i - 1:i].isalnum()):
            q, j = src[i], i + 1
            while j < n and src[j] != q:
                j += 2 if src[j] == "\\" else 1
            out.append(q + re.sub(r"[^\n]", " ", src[i + 1:j]) + q)
            i = j + 1
        else:
            out.append(src[i])
            i += 1
    return "".join(out)
