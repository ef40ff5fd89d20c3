#!/bin/sh
# Runs inside the debootstrapped forky root (chroot) once, before `docker import`.
# The same steps as ../customize.sh (Slurm 24.11, trixie).
set -eu
# Test users: the same uid on every node because every node is this image.
useradd -m -u 2001 -s /bin/bash alice
useradd -m -u 2002 -s /bin/bash bob
# Slurm's daemons run as SlurmUser=slurm (the user Debian's packages create), as sites run them.
mkdir -p /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge /fsx /src
chown slurm:slurm /var/spool/slurmctld /var/log/slurm
chown munge:munge /run/munge
# gpuwarden itself is NOT in the image: each container installs the wheel `up` built from the
# working tree (docker-cluster/entrypoint.sh).
# slurmdbd 26.05.5 fails the same way as 24.11.5 with forky's Connector/C (libmariadb3
# 11.8.9): error 5027 on `select @var := concat('')`, then fatal. So this image, too, carries
# bookworm's libmariadb3 (Connector/C 3.3) for slurmdbd alone (docker-cluster/entrypoint.sh).
mirror=$(sed -n 's/^deb \([^ ]*\) forky main.*/\1/p' /etc/apt/sources.list | head -n1)
echo "deb ${mirror:-http://deb.debian.org/debian} bookworm main" > /etc/apt/sources.list.d/bookworm.list
# Read bookworm's index alone: forky's Release carries a Valid-Until (testing's is a week), so
# an older mirror snapshot fails `apt-get update` on it; debootstrap never checked that.
apt-get update -qq -o Dir::Etc::SourceList=sources.list.d/bookworm.list -o Dir::Etc::SourceParts=-
(cd /tmp && apt-get download -qq libmariadb3/bookworm && \
    dpkg-deb -x libmariadb3_*.deb /opt/libmariadb-bookworm && rm -f libmariadb3_*.deb)
rm /etc/apt/sources.list.d/bookworm.list
test -f /opt/libmariadb-bookworm/usr/lib/x86_64-linux-gnu/libmariadb.so.3
apt-get clean
rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /usr/share/doc/* /usr/share/man/*
