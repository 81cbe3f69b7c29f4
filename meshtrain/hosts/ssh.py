"""SSH to the hosts of an inventory with paramiko: connect, run, start and stop processes.

Host keys are checked against known_hosts and unknown ones refused, unless the user
opts in to accepting new (never changed) keys, which are then recorded like OpenSSH's
``StrictHostKeyChecking=accept-new``. No passwords: keys from identity_file or ssh-agent.

Remote processes run under a pty, so that when the SSH connection closes (teardown,
or the launcher itself dying) the kernel hangs up their terminal and they get SIGHUP.
Their process group id is printed first, so teardown can also kill the whole group
from a second channel if a process ignores the hang-up.
"""

from __future__ import annotations

import os
import re
import secrets
import shlex
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import paramiko

from meshtrain.errors import RunFailure
from meshtrain.heartbeat import BEAT, FAREWELL, HEARTBEAT_FD
from meshtrain.hosts.host_output import EXIT_PRINTF, LineSplitter, take_exit_status, visible
from meshtrain.hosts.inventory import Host
from meshtrain.hosts.known_hosts import KnownHosts, append_known_host, load_known_hosts

CONNECT_TIMEOUT = 10.0
KEEPALIVE_SECONDS = 5
# When paramiko starts a rekey itself (by default after 512 MiB) and the host closes a
# channel before the key exchange ends, paramiko's transport thread waits on itself and
# the connection dies 30 s later with "Key-exchange timed out waiting for key negotiation"
# (paramiko issue #822): a copy-back of a 512 MiB run directory failed every time. OpenSSH
# rekeys an AES connection after 2**32 blocks of 16 bytes, and so do we; its sshd starts
# the same rekey itself, which paramiko handles without that wait.
REKEY_BYTES = 16 << 32
REKEY_PACKETS = 1 << 31  # OpenSSH's MAX_PACKETS
WEAK_CIPHERS = ["3des-cbc"]  # 8-byte blocks (Sweet32); every cipher left has 16-byte blocks
PID_MARKER = "__MESHTRAIN_PID__"
UNREPORTED = -1  # RemoteProcess.exit_status(): the session ended without the command's status
BLOCKED_PRINT = 1.0  # seconds printing a chunk of output may take before we count it as blocked


class SSHError(RunFailure):
    """Connecting to or running on a host failed; the message is one line with the fix.
    It may quote what the host said: control characters are written out (:func:`visible`)."""

    def __init__(self, host: Host, message: str) -> None:
        super().__init__(visible(f"{host.name} ({host.label}): {message}"))
        self.host = host


class UnknownHostKey(paramiko.SSHException):
    """The host's key is not in known_hosts and accepting new keys was not asked for."""

    def __init__(self, hostname: str, key: paramiko.PKey) -> None:
        super().__init__(f"unknown host key for {hostname}")
        self.hostname = hostname
        self.key = key


class RevokedHostKey(paramiko.SSHException):
    """The host presented a key marked ``@revoked`` in known_hosts."""

    def __init__(self, hostname: str, key: paramiko.PKey) -> None:
        super().__init__(f"revoked host key for {hostname}")
        self.hostname = hostname
        self.key = key


class _HostKeyPolicy(paramiko.MissingHostKeyPolicy):
    """Called by paramiko for a key known_hosts does not list for the host.

    A revoked key is refused first. Otherwise an unknown key is refused, or, when the
    user opted in, trusted and recorded (OpenSSH's ``accept-new``). A key that differs
    from a recorded one never gets here: paramiko raises BadHostKeyException first.
    """

    def __init__(self, known: KnownHosts, path: str, accept_new: bool) -> None:
        self.known, self.path, self.accept_new = known, path, accept_new

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        if self.known.is_revoked(hostname, key):
            raise RevokedHostKey(hostname, key)
        if not self.accept_new:
            raise UnknownHostKey(hostname, key)
        client.get_host_keys().add(hostname, key.get_name(), key)
        append_known_host(self.path, hostname, key)


def known_hosts_name(host: Host) -> str:
    """How known_hosts names this host (OpenSSH's ``[host]:port`` form off port 22)."""
    return host.hostname if host.port == 22 else f"[{host.hostname}]:{host.port}"


# First words of an OpenSSH public key line (the .pub half of a key pair).
_PUBLIC_KEY_TYPES = ("ssh-", "ecdsa-", "sk-ssh-", "sk-ecdsa-")


def identity_file_problem(path: str) -> str | None:
    """Why ``path`` cannot be the private key of a login, or None when it looks like one.

    Checked before connecting so that a public key, random bytes or a folder is one line
    naming the file (paramiko would fail later with a decode error or no reason at all).
    """
    file = Path(path)
    if not file.exists():
        return f"identity_file {path} does not exist"
    if not file.is_file():
        return f"identity_file {path} is a folder, not a private key file"
    try:
        text = file.read_bytes().decode("utf-8")
    except OSError as exc:
        return f"identity_file {path}: cannot read it ({exc.strerror})"
    except UnicodeDecodeError:
        return (f"identity_file {path}: not an SSH private key (binary data; a key file starts "
                "with -----BEGIN ... PRIVATE KEY-----)")
    words = text.split()
    if words and words[0].startswith(_PUBLIC_KEY_TYPES):
        private = path.removesuffix(".pub") if path.endswith(".pub") else "the file without .pub"
        return f"identity_file {path}: this is a public key; give the private key file ({private})"
    if "PRIVATE KEY-----" not in text:
        return (f"identity_file {path}: not an SSH private key (no -----BEGIN ... PRIVATE KEY----- "
                "line)")
    return None


def connect(
    host: Host, *, accept_new_host_keys: bool = False, timeout: float = CONNECT_TIMEOUT
) -> paramiko.SSHClient:
    """An authenticated SSH connection to ``host``, with keepalive on.

    Raises :class:`SSHError` with a one-line reason and fix for every usual failure:
    unreachable, unknown or changed host key, authentication refused, missing key file.
    """
    if host.identity_file is not None:
        problem = identity_file_problem(host.identity_file)
        if problem:
            raise SSHError(host, problem)
    client = paramiko.SSHClient()
    try:
        known = load_known_hosts(host.known_hosts)
    except OSError as exc:
        raise SSHError(host, f"cannot read known_hosts {host.known_hosts}: {exc.strerror}") from None
    for name in known.keys.keys():
        for kind, key in known.keys[name].items():
            if not known.is_revoked(known_hosts_name(host), key):  # revoked: never trusted
                client.get_host_keys().add(name, kind, key)
    client.set_missing_host_key_policy(_HostKeyPolicy(known, host.known_hosts, accept_new_host_keys))
    try:
        client.connect(
            host.hostname, port=host.port, username=host.user,
            key_filename=host.identity_file, look_for_keys=host.identity_file is None,
            allow_agent=True, timeout=timeout, banner_timeout=timeout, auth_timeout=timeout,
            channel_timeout=timeout, disabled_algorithms={"ciphers": WEAK_CIPHERS},
        )
    except UnknownHostKey as exc:
        client.close()
        raise SSHError(
            host,
            f"unknown host key ({exc.key.get_name()} {exc.key.fingerprint}) not in {host.known_hosts}; "
            f"check the fingerprint and accept it with --accept-new-host-keys, or run "
            f"`ssh -p {host.port} {host.user}@{host.hostname}` once",
        ) from None
    except RevokedHostKey as exc:
        client.close()
        raise SSHError(host, _revoked_message(host, exc.key)) from None
    except paramiko.BadHostKeyException as exc:
        client.close()
        if known.is_revoked(known_hosts_name(host), exc.key):
            raise SSHError(host, _revoked_message(host, exc.key)) from None
        raise SSHError(
            host,
            f"HOST KEY CHANGED (now {exc.key.get_name()} {exc.key.fingerprint}); refusing to connect "
            f"(a reinstalled host, or someone in the middle). If the change is expected: "
            f"ssh-keygen -R '{known_hosts_name(host)}' -f {host.known_hosts}, then accept the new key",
        ) from None
    except paramiko.PasswordRequiredException:
        client.close()
        raise SSHError(host, f"key {host.identity_file} has a passphrase: add it to ssh-agent "
                             "(ssh-add) and try again") from None
    except paramiko.AuthenticationException:
        client.close()
        key = host.identity_file or "ssh-agent / ~/.ssh/id_*"
        raise SSHError(
            host,
            f"authentication refused for user {host.user!r} with key {key}: add the public key to "
            f"~/.ssh/authorized_keys on the host (ssh-copy-id), and check 'user' in the inventory",
        ) from None
    except (paramiko.ssh_exception.NoValidConnectionsError, ConnectionError) as exc:
        client.close()
        raise SSHError(host, f"cannot reach port {host.port} ({_reason(exc)}): is the host on and "
                             "SSH (Remote Login) enabled?") from None
    except TimeoutError:
        client.close()
        raise SSHError(host, f"no answer within {timeout:.0f} s: wrong address, host asleep, "
                             "or a firewall dropping port " + str(host.port)) from None
    except socket.gaierror as exc:
        client.close()
        raise SSHError(host, f"cannot resolve {host.hostname!r} ({exc.strerror})") from None
    except (paramiko.SSHException, OSError) as exc:
        client.close()
        raise SSHError(host, f"SSH failed: {exc}") from None
    transport = client.get_transport()
    assert transport is not None
    transport.set_keepalive(KEEPALIVE_SECONDS)
    transport.packetizer.REKEY_BYTES = REKEY_BYTES  # this connection's, not the class's
    transport.packetizer.REKEY_PACKETS = REKEY_PACKETS
    return client


def _revoked_message(host: Host, key: paramiko.PKey) -> str:
    return (f"host key {key.get_name()} {key.fingerprint} is marked @revoked in {host.known_hosts}; "
            "refusing to connect (the host must get a new key, which you then accept)")


def _reason(exc: Exception) -> str:
    # paramiko folds the errors of every address tried into one exception.
    causes = list(getattr(exc, "errors", {}).values()) or [exc]
    for cause in causes:
        if isinstance(cause, OSError) and cause.errno is not None:
            return os.strerror(cause.errno).lower()
    return str(exc)


@dataclass
class Result:
    """A finished remote command."""

    status: int
    stdout: str
    stderr: str


class OutputTooLarge(RunFailure, ConnectionError):
    """A host answered a question with more output than it may send."""


#: What a question to a host may print (on stdout, and on stderr), unless its caller allows more.
ANSWER_LIMIT = 1 << 20


def run(client: paramiko.SSHClient, command: str, *, timeout: float = 60.0,
        stdin: bytes | None = None, max_output: int = ANSWER_LIMIT, hang_up: bool = False) -> Result:
    """Run ``command`` (a POSIX shell line) and wait for it; no pty, separate stderr.

    ``stdin`` is written to the command's standard input, then closed (no pty: nothing
    is echoed, and nothing appears on any command line). More than ``max_output`` bytes on
    stdout or stderr raises :class:`OutputTooLarge`: a host's answer is read in bounded
    memory, whatever its shell's start-up files print.

    Without a pty a command outlives its connection (Ctrl-C here, a dropped link). A long
    one (a pip install) runs with ``hang_up``: under a pty, whose hang-up when the
    connection closes ends it; its stderr then comes merged into stdout, and it takes no
    ``stdin`` (a pty would echo it and read control characters in it).

    stderr is read in a second thread while this one reads stdout: SSH's flow control is one
    window per channel, so a command that fills one stream while the other is not read
    stops until ``timeout`` (a 2 MiB flood on either used to stall a question for a minute).
    """
    if hang_up and stdin is not None:
        raise ValueError("run(hang_up=True) takes no stdin")
    transport = client.get_transport()
    if transport is None or not transport.is_active():
        raise ConnectionError("SSH connection is closed")
    channel = transport.open_session(timeout=timeout)
    try:
        channel.settimeout(timeout)
        if hang_up:
            channel.get_pty(term="dumb", width=200, height=50)  # "dumb": no colours, no cursor codes
        channel.exec_command(command)
        if stdin is not None:
            channel.sendall(stdin)
            channel.shutdown_write()
        limit = max_output + 1
        errors: list[bytes | BaseException] = []

        def read_stderr() -> None:
            try:
                errors.append(data := channel.makefile_stderr("rb").read(limit))
                if len(data) > max_output:
                    channel.close()  # a flood: the stdout read below ends too
            except BaseException as exc:  # noqa: BLE001 - raised below, in the caller's thread
                errors.append(exc)

        reader = threading.Thread(target=read_stderr, name="meshtrain-ssh-stderr", daemon=True)
        reader.start()
        out = channel.makefile("rb").read(limit)
        if len(out) > max_output:
            channel.close()  # a flood: the stderr read ends at once
        reader.join(timeout)
        if not errors:
            raise TimeoutError(f"no end of stderr within {timeout:g} s from {command[:60]!r}")
        err = errors[0]
        if isinstance(err, BaseException):
            raise err
        if max(len(out), len(err)) > max_output:
            raise OutputTooLarge(f"more than {max_output} bytes of output from {command[:60]!r}")
        return Result(channel.recv_exit_status(), out.decode(errors="replace"), err.decode(errors="replace"))
    finally:
        channel.close()


# --------------------------------------------------------------------------- quoting
class Shell(str):
    """Shell syntax the launcher itself wrote (``&&``, ``|| exit 41``, ``2>/dev/null``), or
    a line :func:`shell_line` built: joined as it is. Never made from a value that came
    from the user, the inventory or a host."""


class HostPath(str):
    """A path on the host: quoted whole, except that a leading ``~/`` (or a lone ``~``)
    stays outside the quotes so the host's shell expands it to the home folder."""


class EnvAssignment(str):
    """``NAME=value`` before a program: the name must be a shell identifier, the value is quoted."""

    def __new__(cls, name: str, value: str) -> EnvAssignment:
        if not _IDENTIFIER.match(name):
            raise ValueError(f"{name!r} is not a valid environment variable name")
        return super().__new__(cls, f"{name}={shlex.quote(value)}")


_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def shell_line(*words: str) -> str:
    """THE way every remote command is built: a POSIX shell line from ``words``.

    A plain ``str`` is one word, quoted (whatever it holds: ``;``, ``$()``, backticks,
    quotes, newlines, spaces stay text); a :class:`HostPath` is quoted but keeps a
    leading ``~/`` expandable; an :class:`EnvAssignment` is ``NAME='value'``; a
    :class:`Shell` is the launcher's own syntax, joined as is.
    """
    out = []
    for word in words:
        if isinstance(word, (Shell, EnvAssignment)):
            out.append(str(word))
        elif isinstance(word, HostPath):
            out.append(_quoted_path(word))
        else:
            out.append(shlex.quote(word))
    return " ".join(out)


def _quoted_path(path: str) -> str:
    if path == "~":
        return "~"
    if path.startswith("~/"):
        return "~/" + shlex.quote(path[2:])
    return shlex.quote(path)


def sh(line: str) -> str:
    """``line`` (built by :func:`shell_line`) run by /bin/sh, whatever the login shell of
    the account is."""
    return shell_line("/bin/sh", "-c", line)


class RemoteProcess:
    """A command running on a host under a pty, its output delivered line by line.

    The command's own stdout is a pipe, not the pty, so it prints plain lines rather
    than redrawing progress bars. Its descriptor 3 is the same pipe: a launched rank
    writes its heartbeat bytes there (see heartbeat.py); they are taken out of the output
    and timed in ``last_beat``. Its exit status comes back in a frame keyed with a random
    key that only the wrapping shell knows (see host_output.py): whatever the program
    prints cannot end it. Lines are bounded (:class:`LineSplitter`); no line, however
    malformed, stops the reader.
    """

    def __init__(self, client: paramiko.SSHClient, command: str, on_line: Callable[[str], None]) -> None:
        """Start ``command`` (a line built by :func:`shell_line`); ``on_line`` gets its output."""
        self.client = client
        self.on_line = on_line
        self.pgid: int | None = None  # the remote process group, killed on teardown
        self.status: int | None = None  # the command's exit status, once known
        self.last_beat: float | None = None  # monotonic time of the last heartbeat; None: none yet
        self.exiting = False  # the rank's program is done (FAREWELL): its interpreter is exiting
        self.reader_error: str | None = None  # the first line the reader could not handle
        self._delivering = False
        self._pid_seen = threading.Event()
        self._key = secrets.token_hex(16)  # authenticates the exit frame
        self.lines = LineSplitter()
        transport = client.get_transport()
        if transport is None or not transport.is_active():
            raise ConnectionError("SSH connection is closed")
        self.transport = transport
        self.channel = transport.open_session(timeout=CONNECT_TIMEOUT)
        self.channel.get_pty(term="dumb", width=200, height=50)
        # sshd makes the pty's shell a session leader; ask ps in case a login shell forked.
        # No echo: the key arrives on the pty, and the Ctrl-C sent on teardown would come
        # back as a "^C" line. The key is read before the command starts, whose stdin is
        # /dev/null: it never sees it.
        report = shell_line("printf", EXIT_PRINTF, Shell('"$key" $?'))
        script = (f"stty -echo 2>/dev/null; echo {PID_MARKER} $(ps -o pgid= -p $$ 2>/dev/null || echo $$); "
                  f"IFS= read -r key || exit 1; "
                  f"{{ {command} ; {report} ; }} "
                  f"2>&1 {HEARTBEAT_FD}>&1 < /dev/null | cat")
        self.channel.exec_command(sh(script))
        self._reader = threading.Thread(target=self._read, name="meshtrain-ssh-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            while True:
                data = self.channel.recv(65536)
                if not data:
                    break
                if BEAT in data:
                    self.last_beat = time.monotonic()
                    data = data.replace(BEAT, b"")
                if FAREWELL in data:
                    self.exiting = True
                    data = data.replace(FAREWELL, b"")
                lines = self.lines.feed(data)
                self._delivering, started = True, time.monotonic()  # see beat_silence()
                try:
                    for raw in lines:
                        self._safely(raw)
                finally:
                    self._delivering = False
                    if self.last_beat is not None and time.monotonic() - started > BLOCKED_PRINT:
                        self.last_beat = time.monotonic()  # its beats waited unread: a fresh window
        except (OSError, EOFError, paramiko.SSHException):
            pass  # connection lost: the caller sees it through finished()/connected
        rest = self.lines.flush()
        if rest is not None:
            self._safely(rest)

    def _safely(self, raw: bytes) -> None:
        """Handle one line; a failure is reported once and the reader goes on."""
        try:
            self._line(raw.decode(errors="replace").rstrip("\r"))
        except Exception as exc:  # noqa: BLE001 - hostile or broken input must not end the reader
            if self.reader_error is None:
                self.reader_error = f"{type(exc).__name__}: {exc}"
                try:
                    self.on_line(visible(f"[meshtrain: could not handle a line of this rank's output: "
                                         f"{self.reader_error}]"))
                except Exception:  # noqa: BLE001 - the output itself is broken: nothing else to tell
                    pass

    def beat_silence(self) -> float | None:
        """Seconds since the rank's last heartbeat; None before its first. Time this side
        spent blocked printing its output (a paused terminal, a full pipe) is not the
        rank's silence: beats waited unread meanwhile."""
        if self.last_beat is None or self._delivering:
            return None if self.last_beat is None else 0.0
        return time.monotonic() - self.last_beat

    def _line(self, line: str) -> None:
        if not self._pid_seen.is_set() and line.startswith(PID_MARKER):
            # The shell's line before the command starts; taken once, so no later print counts.
            self._pid_seen.set()
            words = line.split()
            if len(words) == 2 and words[1].isascii() and words[1].isdigit() and int(words[1]) > 1:
                self.pgid = int(words[1])  # else none: teardown relies on the hang-up alone
            self.channel.sendall(f"{self._key}\n".encode())  # echo is off by now
            return
        if self.status is None:
            line, status = take_exit_status(line, self._key)
            if status is not None:
                self.status = status
                if not line:
                    return
        self.on_line(line)

    def wait_started(self, timeout: float) -> bool:
        """Whether the remote shell reported its process group within ``timeout`` seconds."""
        return self._pid_seen.wait(timeout)

    @property
    def finished(self) -> bool:
        """The command ended (its keyed exit frame came, even if children it left hold the
        output pipe open), or the session or connection closed."""
        return (self.status is not None or self.channel.exit_status_ready() or self.channel.closed
                or not self.transport.is_active())

    def exit_status(self) -> int | None:
        """The command's exit status; None while it runs or if the connection was lost;
        :data:`UNREPORTED` if the session ended cleanly without the keyed exit frame (the
        wrapping shell was killed: a clean end of the session alone proves nothing)."""
        if self.status is not None:
            return self.status
        if not self.finished:
            return None
        self._reader.join(timeout=2.0)  # the exit frame may still be in flight
        if self.status is not None:
            return self.status
        if self.channel.exit_status_ready():
            status = self.channel.recv_exit_status()
            if status == 0:
                return UNREPORTED
            return status if status > 0 else 128 + 1  # -1: killed by a signal (hang-up)
        return None

    def interrupt(self) -> None:
        """Ctrl-C on the pty: SIGINT to the whole remote process group."""
        try:
            self.channel.send(b"\x03")
        except (OSError, EOFError, paramiko.SSHException):
            pass

    def stop_group(self, grace: float) -> bool:
        """SIGTERM to the remote process group, SIGKILL after ``grace`` seconds if any of it
        is left; True once the group is gone. Run from a second channel: the command's shell
        may be gone already while children that ignore hang-ups live on."""
        if self.pgid is None:
            return True
        g, polls = self.pgid, max(1, int(grace / 0.1))
        # SIGCONT after SIGTERM: a stopped (SIGSTOP, Ctrl-Z) process acts on SIGTERM only once
        # it runs again; otherwise it would wait for the SIGKILL.
        script = (f"kill -TERM -{g} 2>/dev/null || exit 0; kill -CONT -{g} 2>/dev/null; i=0; "
                  f"while kill -0 -{g} 2>/dev/null; do i=$((i+1)); "
                  f"if [ $i -gt {polls} ]; then kill -KILL -{g} 2>/dev/null; sleep 0.2; break; fi; "
                  f"sleep 0.1; done; kill -0 -{g} 2>/dev/null && exit 1; exit 0")
        return run(self.client, sh(script), timeout=grace + 5.0).status == 0

    def close(self) -> None:
        """Close the channel: the pty hangs up, SIGHUP to whatever is left."""
        try:
            self.channel.close()
        except Exception:  # noqa: BLE001 - closing a dead channel is fine
            pass


class Heartbeat:
    """Round trips on an SSH connection, to notice a host that dropped off the network.

    TCP alone can take many minutes to give up on a host that vanished; an answered
    SSH request every ``interval`` seconds tells us within a few seconds.
    """

    def __init__(self, client: paramiko.SSHClient, interval: float = 1.0) -> None:
        transport = client.get_transport()
        assert transport is not None
        self.transport = transport
        self.interval = interval
        self.last_answer = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="meshtrain-heartbeat", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval) and self.transport.is_active():
            try:
                # sshd answers unknown global requests with a failure: any answer is a round trip.
                self.transport.global_request("keepalive@openssh.com", wait=True)
            except Exception:  # noqa: BLE001 - a dead transport ends the loop
                return
            if self.transport.is_active():
                self.last_answer = time.monotonic()

    def silent_for(self) -> float:
        """Seconds since the host last answered."""
        return time.monotonic() - self.last_answer

    def stop(self) -> None:
        self._stop.set()
