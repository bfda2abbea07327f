"""Run a command with a terminal as its controlling terminal: ``with_ctty.py TTY -- ARGV...``.

What ``elasticd --standalone &`` typed into a root shell amounts to: the
daemon's session has that shell's terminal. This makes a new session, opens
TTY (a pty's slave the test holds the master of) as its controlling
terminal and stdin, then execs ARGV, so the pid the caller got is ARGV's.
"""
import fcntl
import os
import sys
import termios

tty, argv = sys.argv[1], sys.argv[3:] if sys.argv[2] == "--" else sys.argv[2:]
os.setsid()
fd = os.open(tty, os.O_RDWR)
fcntl.ioctl(fd, termios.TIOCSCTTY, 0)
os.dup2(fd, 0)
os.close(fd)
os.execvp(argv[0], argv)
