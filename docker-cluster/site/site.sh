#!/bin/bash
# Entrypoint of the plain Slurm site that tests/e2e/test_admin_guide.py installs gpuwarden on:
# `site.sh head` (MariaDB, slurmdbd, slurmctld) or `site.sh node` (slurmd). No gpuwarden here:
# the test installs it by docs/admin-guide.md. The daemons run in the background, as systemd
# would run them, so `scontrol reconfigure` can restart them in place.
set -euo pipefail
role=${1:?role: head or node}
seed=/etc/site-seed

# The image is the cluster image less the packages the guide installs (plain.sh, run once).
if python3 -c 'import numpy' 2>/dev/null; then
    echo "site.sh: this image still has what the guide installs (run plain.sh first)" >&2
    exit 2
fi

install -o munge -g munge -m 0400 "$seed/munge.key" /etc/munge/munge.key
install -d -o munge -g munge -m 0755 /run/munge
runuser -u munge -- /usr/sbin/munged --force
mkdir -p /etc/slurm
install -m 0644 "$seed/slurm.conf" "$seed/gres.conf" "$seed/cgroup.conf" /etc/slurm/
install -d -o slurm -g slurm -m 0755 /run/slurm /var/log/slurm

case "$role" in
head)
    install -o slurm -g slurm -m 0600 "$seed/slurmdbd.conf" /etc/slurm/slurmdbd.conf
    mkdir -p /run/mysqld && chown mysql:mysql /run/mysqld
    mariadb-install-db --user=mysql --datadir=/var/lib/mysql >/dev/null
    mariadbd --user=mysql --bind-address=127.0.0.1 &
    for _ in $(seq 1 120); do mariadb -e 'select 1' >/dev/null 2>&1 && break; sleep 0.5; done
    pass=$(sed -n 's/^StoragePass=//p' /etc/slurm/slurmdbd.conf)
    mariadb -e "CREATE USER 'slurm'@'localhost' IDENTIFIED BY '$pass';
                GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost'; FLUSH PRIVILEGES;"
    # docker-cluster/image/customize.sh: slurmdbd 24.11 needs bookworm's Connector/C.
    LD_LIBRARY_PATH=/opt/libmariadb-bookworm/usr/lib/x86_64-linux-gnu slurmdbd
    for _ in $(seq 1 120); do sacctmgr -n show cluster >/dev/null 2>&1 && break; sleep 0.5; done
    sacctmgr -i add cluster site >/dev/null
    sacctmgr -i add account research cluster=site description=users organization=site >/dev/null
    sacctmgr -i add user root,alice account=research cluster=site >/dev/null
    slurmctld
    ;;
node)
    mkdir -p /opt/fakegpu
    for i in $(seq 0 7); do : > "/opt/fakegpu/nvidia$i"; done
    slurmd
    ;;
*)
    echo "unknown role $role" >&2
    exit 2
    ;;
esac
echo "site $role up"
exec sleep infinity
