#!/bin/sh
# Runs inside the debootstrapped root (chroot) once, before `docker import`.
set -eu
# Test users: the same uid on every node because every node is this image.
useradd -m -u 2001 -s /bin/bash alice
useradd -m -u 2002 -s /bin/bash bob
# Slurm's daemons run as SlurmUser=slurm (the user Debian's packages create), as sites run them.
mkdir -p /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge /fsx /src
chown slurm:slurm /var/spool/slurmctld /var/log/slurm
chown munge:munge /run/munge
# gpuwarden itself is NOT in the image: each container installs the wheel `up` built from the
# working tree, by the admin guide's steps (docker-cluster/entrypoint.sh), so the tests run
# what a site installs.
# slurmdbd 24.11.5 cannot use trixie's Connector/C (libmariadb3 11.8.9): every query fails
# with error 5027 "Number of columns in result set exceeds maximum allowed (=0)". Bookworm's
# libmariadb3 (Connector/C 3.3) works against the 11.8 server; slurmdbd alone loads it.
mirror=$(sed -n 's/^deb \([^ ]*\) trixie main.*/\1/p' /etc/apt/sources.list | head -n1)
echo "deb ${mirror:-http://deb.debian.org/debian} bookworm main" > /etc/apt/sources.list.d/bookworm.list
apt-get update -qq
(cd /tmp && apt-get download -qq libmariadb3/bookworm && \
    dpkg-deb -x libmariadb3_*.deb /opt/libmariadb-bookworm && rm -f libmariadb3_*.deb)
rm /etc/apt/sources.list.d/bookworm.list
test -f /opt/libmariadb-bookworm/usr/lib/x86_64-linux-gnu/libmariadb.so.3
apt-get clean
rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /usr/share/doc/* /usr/share/man/*
