"""A corpus of tricky Dockerfile spellings: each hides an attack that BuildKit's reading
shows, and the policy must refuse, or (None) that the policy lets through to the network,
which stops it: an ADD of an address the build must not reach. Shared by the unit test of
the policy and the real builds in tests/security."""

import dockerfile

BASE = "localhost/campugrid/python:bookworm"
F = f"FROM {BASE}\n"
DIGEST = "sha256:" + "ab" * 32
OTHER = "sha256:" + "cd" * 32


def buildkit_reads(text: str) -> str:
    """What BuildKit acts on: each instruction joined, with its flags, one per line."""
    return "\n".join(f"{c.cmd.upper()} {' '.join(c.flags)} {' '.join(c.value)}"
                     for c in dockerfile.parse_string(text))


# (name, Dockerfile, what BuildKit reads in it, what the refusal says; None: an http(s) ADD,
# allowed by the check, that the egress proxy must refuse)
CORPUS = [
    ("continued URL", F + "ADD http:/\\\n/127.0.0.1:8750/v1/jobs /j\n",
     "http://127.0.0.1:8750/v1/jobs", None),
    ("continued URL, comment between", F + "ADD http:/\\\n# innocent\n/127.0.0.1:8888/ /j\n",
     "http://127.0.0.1:8888/", None),
    ("continued URL, CRLF", F.replace("\n", "\r\n") + "ADD http:/\\\r\n/127.0.0.1/ /j\r\n",
     "http://127.0.0.1/", None),
    ("escape directive", "# escape=`\n" + F + "ADD http:/`\n/127.0.0.1:8333/ /j\n",
     "http://127.0.0.1:8333/", None),
    ("lower-case instruction", F + "add http://127.0.0.1/ /j\n", "ADD  http://127.0.0.1/", None),
    ("tab separated", F + "ADD\thttp://127.0.0.1/\t/j\n", "http://127.0.0.1/", None),
    ("upper-case scheme", F + "ADD HTTP://127.0.0.1/ /j\n", "HTTP://127.0.0.1/", None),
    ("JSON form", F + 'ADD ["http://127.0.0.1/", "/j"]\n', "http://127.0.0.1/", None),
    ("after a flag", F + "ADD --chown=0:0 http://127.0.0.1/ /j\n", "--chown=0:0 http://", None),
    ("git URL", F + "ADD git@github.com:a/b.git /b\n", "git@github.com", "http:// and https:// URLs only"),
    ("COPY of a URL", F + "COPY http://127.0.0.1/ /j\n", "http://127.0.0.1/", "COPY takes files"),
    ("ARG holding a URL", F + "ARG U=http://127.0.0.1:8750/v1/jobs\nADD $U /j\n", "ADD  $U", None),
    ("braced ARG", F + "ARG U=http://127.0.0.1/\nADD ${U} /j\n", "${U}", None),
    ("ENV holding a URL", F + "ENV U=http://127.0.0.1/\nADD ${U}x /j\n", "${U}x", None),
    ("default of an unset ARG", F + "ARG N=\nADD ${N:-http://127.0.0.1/} /j\n", "${N:-http", None),
    ("alternative of a set ARG", F + "ARG N=1\nADD ${N:+http://127.0.0.1/} /j\n", "${N:+http", None),
    ("ARG with no value", F + "ARG U\nADD $U /j\n", "ADD  $U", "plain word"),
    ("undeclared variable", F + "ADD $HOME/x /j\n", "$HOME", "plain word"),
    ("quoted URL", F + 'ADD "http://127.0.0.1/" /j\n', '"http://127.0.0.1/"', "plain word"),
    ("quotes inside the scheme", F + 'ADD ht"tp"://127.0.0.1/ /j\n', 'ht"tp"://', "plain word"),
    ("escaped letters", F + "ADD h\\ttp:\\/\\/127.0.0.1/ /j\n", "h\\ttp:\\/\\/", "plain word"),
    ("a $ form we do not expand", F + "ARG U=x\nADD ${U/x/http://127.0.0.1/} /j\n", "${U/x/", "plain word"),
    ("command substitution", F + "ADD $(echo http://127.0.0.1/) /j\n", "$(echo", "plain word"),
    ("RUN --mount, continued", F + "RUN --mo\\\nunt=type=cache,target=/h ls\n",
     "--mount=type=cache,target=/h", "RUN --mount"),
    ("RUN --mount, upper case", F + "RUN --MOUNT=type=bind,target=/h ls\n", "--MOUNT=", "RUN --mount"),
    ("RUN --mount from an image", F + "RUN --mount=type=bind,from=other:1,target=/h ls\n",
     "from=other:1", "RUN --mount"),
    ("RUN --network=host", F + "RUN --network=host curl x\n", "--network=host", "nothing else"),
    ("RUN --security=insecure", F + "RUN --security=insecure id\n", "--security=insecure", "not available"),
    ("heredoc hiding an ADD", F + "RUN <<EOF\nADD http://127.0.0.1/ /j\nEOF\n", "RUN  <<EOF", "heredocs"),
    ("heredoc after a command", F + "RUN cat <<EOF\nADD http://127.0.0.1/ /j\nEOF\n", "RUN  cat <<EOF",
     "heredocs"),
    ("heredoc with tabs", F + "RUN cat <<-EOF\n\tADD http://127.0.0.1/ /j\n\tEOF\n", "RUN  cat <<-EOF",
     "heredocs"),
    ("heredoc in COPY", F + "COPY <<EOF /x\nhello\nEOF\n", "COPY  <<EOF", "heredocs"),
    ("ONBUILD", F + "ONBUILD ADD http://127.0.0.1/ /j\n", "ONBUILD  http://", "ONBUILD"),
    ("COPY --from an image on another registry",
     F + "COPY --from=evil.example/x/alpine:3 /etc/passwd /p\n", "--from=evil.example/x/alpine:3",
     "not an allowed registry"),
    ("COPY --from another job's image", F + "COPY --from=localhost/campugrid-job/a-1/j:1 /x /x\n",
     "--from=localhost/campugrid-job/a-1/j:1", "not an allowed registry"),
    ("COPY --from an image id", F + "COPY --from=81904ac8d660 /x /x\n", "--from=81904ac8d660",
     "that is an image id"),
    ("COPY --from a later stage", F + "COPY --from=later /x /x\n" + F.strip() + " AS later\n",
     "--from=later", "this stage or a later one"),
    ("COPY --from its own index", F + "COPY --from=0 /x /x\n", "--from=0", "earlier stage"),
    ("COPY --from through ARG", "ARG I=evil.example/x/alpine:3\n" + F + "ARG I\nCOPY --from=$I /x /x\n",
     "--from=$I", "not an allowed registry"),
    ("ADD --from", F + "ADD --from=other:1 /x /x\n", "--from=other:1", "ADD --from is not available"),
    ("another job's image", "FROM localhost/campugrid-job/a-1/j:1\n", "localhost/campugrid-job", "not an allowed base"),
    ("an image id as base", "FROM 81904ac8d660\n", "FROM  81904ac8d660", "not an allowed base"),
    ("the base without its tag", "FROM localhost/campugrid/python\n", "localhost/campugrid/python", "not an allowed base"),
    ("a base through ARG", "ARG B=localhost/campugrid-job/a-1/j:1\nFROM $B\n", "FROM  $B", "not an allowed base"),
    ("a base through an unset ARG", "ARG B\nFROM ${B:-localhost/evil:1}\n", "${B:-localhost/evil:1}", "plain word"),
    ("a stage named like a path", f"FROM {BASE} AS a/b\n", "AS a/b", "stage name"),
    ("an unknown instruction", F + "FROBNICATE now\n", "FROBNICATE", "unknown instruction"),
    ("RUN before FROM", "RUN id\n" + F, "RUN  id", "before the first FROM"),
]
