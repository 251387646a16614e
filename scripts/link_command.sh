#!/usr/bin/env bash
# link_command.sh OURS LINK: point LINK (/usr/local/bin/fusefs, where mount(8) and fstab find
# the command) at OURS (this checkout's .venv/bin/fusefs). A link to another install (a second
# checkout's) is taken over and the admin told: mount -t fuse.fusefs and fstab ran that one
# until now. A file there that is not a link is left alone, and said so.
set -euo pipefail
ours=$1 link=$2
if [ -e "$link" ] && [ ! -L "$link" ]; then
    echo "setup: $link is not a link (another install of fusefs?): left alone, so mount -t" \
         "fuse.fusefs and fstab run it, not $ours"
    exit 0
fi
if [ -L "$link" ] && [ "$(readlink "$link")" != "$ours" ]; then
    echo "setup: $link pointed to $(readlink "$link") (another install): now to $ours," \
         "which mount -t fuse.fusefs and fstab run from now on"
fi
ln -sfn "$ours" "$link"
