#!/bin/bash
# Container entrypoint of the gpuwarden test cluster: `entrypoint.sh ROLE`.
# /etc/gpuwarden-cluster holds what `up` rendered (slurm.conf, munge.key, the wheel, ...),
# read-only; /src/gpuwarden is the working tree (test-only files such as fake-gpu-job).
set -euo pipefail
role=${1:?role: slurmdbd, slurmctld, node or s3}
state=/etc/gpuwarden-cluster

start_munge() {
    install -o munge -g munge -m 0400 "$state/munge.key" /etc/munge/munge.key
    install -d -o munge -g munge -m 0755 /run/munge
    runuser -u munge -- /usr/sbin/munged --force
}

# gpuwarden as docs/admin-guide.md installs it: the wheel into a venv (Debian's numpy and
# xxhash through --system-site-packages), then its Slurm hooks, plugins and kit under
# /opt/gpuwarden, and /etc/default/gpuwarden naming the venv's interpreter for the hooks.
install_gpuwarden() {
    # --clear: a node the tests killed and started again installs afresh.
    python3 -m venv --clear --system-site-packages --without-pip /opt/gpuwarden/venv
    /opt/gpuwarden/venv/bin/python -m installer "$state"/wheel/gpuwarden-*.whl
    /opt/gpuwarden/venv/bin/gpuwarden install-files /opt/gpuwarden > /var/log/gpuwarden-install.log
    ln -sf /opt/gpuwarden/venv/bin/gpuwarden /usr/local/bin/gpuwarden
}

install_slurm_conf() {
    mkdir -p /etc/slurm
    cp "$state/slurm.conf" "$state/gres.conf" "$state/topology.conf" "$state/cgroup.conf" /etc/slurm/
    # Every sbatch/srun runs gpuwarden's cli_filter (docs/placement.md); slurmdbd's host has
    # Slurm's client commands but no gpuwarden.
    if [ -f /opt/gpuwarden/plugins/cli_filter.lua ]; then
        install -m 0644 /opt/gpuwarden/plugins/cli_filter.lua /etc/slurm/cli_filter.lua
    fi
}

# An objstore site's checkpoint site secret ([ckpt] key_file), as an admin installs it: root's,
# 0600, the same on every node (docs/checkpointing.md); none on an fsx site.
install_ckpt_key() {
    if [ -f "$state/ckpt.key" ]; then
        install -o root -g root -m 0600 "$state/ckpt.key" /etc/gpuwarden/ckpt.key
        # The nodes' S3 credentials for the prolog's stage-in ([ckpt] stage_in_s3_env): the
        # two AWS lines of the cluster's one identity, root's, 0600.
        (umask 077; grep '^AWS_' "$state/s3.env" > /etc/gpuwarden/s3-stagein.env)
    fi
}

# An objstore site (GPUWARDEN_SITE) mounts no /fsx; the image's empty mount point goes too, so
# nothing can use a local /fsx by mistake (a restarted container finds it gone already).
no_fsx() {
    rm -rf /fsx/.canary
    rmdir /fsx 2>/dev/null || [ ! -e /fsx ]
}

# A node's syslog, as on a real host: gpuwarden's hooks send their own errors to /dev/log
# (a prolog that exits 0 has its output discarded by Slurm). No kernel log in a container.
start_syslog() {
    rm -f /run/rsyslogd.pid
    sed -i 's/^module(load="imklog")/#&/' /etc/rsyslog.conf
    rsyslogd
}

case "$role" in
slurmdbd)
    start_munge
    install_slurm_conf
    install -o slurm -g slurm -m 0600 "$state/slurmdbd.conf" /etc/slurm/slurmdbd.conf
    install -d -o slurm -g slurm -m 0755 /run/slurm
    mkdir -p /run/mysqld && chown mysql:mysql /run/mysqld
    if [ ! -d /var/lib/mysql/mysql ]; then
        mariadb-install-db --user=mysql --datadir=/var/lib/mysql >/dev/null
    fi
    # slurmdbd 26.05 logs an error under MariaDB's default innodb_snapshot_isolation=ON (11.6+):
    # a write conflict would stop it. 24.11 does not check; it keeps MariaDB's defaults.
    db_opts=()
    case "$(slurmdbd -V)" in *" 24."*) ;; *) db_opts=(--innodb-snapshot-isolation=OFF) ;; esac
    # --datadir: forky's MariaDB defaults to /var/lib/mariadb; trixie's is /var/lib/mysql.
    mariadbd --user=mysql --datadir=/var/lib/mysql --skip-networking=0 --bind-address=127.0.0.1 \
        "${db_opts[@]}" &
    db=$!
    # Until MariaDB answers, as long as it runs: with eight clusters starting on 2 cores it took
    # longer than the 30 s this waited before, and the container exited (CI, 2026-12-05). The
    # cluster's own start deadline (`up --timeout`) bounds the wait.
    until mariadb -e 'select 1' >/dev/null 2>&1; do
        kill -0 "$db" 2>/dev/null || { echo "mariadbd exited before it answered" >&2; exit 1; }
        sleep 0.5
    done
    pass=$(sed -n 's/^StoragePass=//p' /etc/slurm/slurmdbd.conf)
    mariadb -e "CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$pass';
                GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost'; FLUSH PRIVILEGES;"
    # See docker-cluster/image/customize.sh: slurmdbd needs bookworm's Connector/C.
    LD_LIBRARY_PATH=/opt/libmariadb-bookworm/usr/lib/x86_64-linux-gnu exec slurmdbd -D
    ;;
slurmctld)
    start_munge
    install_gpuwarden
    install_slurm_conf
    install -d -o slurm -g slurm -m 0755 /run/slurm
    install -d -m 0755 /etc/gpuwarden
    cp "$state/gpuwarden.toml" /etc/gpuwarden/gpuwarden.toml
    install_ckpt_key
    [ "${GPUWARDEN_SITE:-fsx}" = fsx ] || no_fsx
    # Placement (docs/placement.md): slurmctld loads job_submit.lua from beside slurm.conf; the
    # daemon keeps its snapshot current. Both come from the installed wheel.
    install -m 0644 /opt/gpuwarden/plugins/job_submit.lua /etc/slurm/job_submit.lua
    gpuwarden placement daemon >> /var/log/gpuwarden-placement.log 2>&1 &
    exec slurmctld -D -i
    ;;
node)
    start_syslog
    start_munge
    install_gpuwarden
    install_slurm_conf
    # Fake GPUs: gres.conf's File= entries must exist (see docs/test-cluster.md).
    mkdir -p /opt/fakegpu
    for i in $(seq 0 $((${GPUWARDEN_GPUS:-8} - 1))); do : > "/opt/fakegpu/nvidia$i"; done
    # What the fake GPU probe and the XID check read; tests inject faults here.
    install -d -m 0755 /var/lib/gpuwarden-fake /etc/gpuwarden
    cp "$state/gpuwarden.toml" /etc/gpuwarden/gpuwarden.toml
    /opt/gpuwarden/venv/bin/python -c "from gpuwarden.health.probe import healthy_fake; print(healthy_fake(${GPUWARDEN_GPUS:-8}))" \
        > /var/lib/gpuwarden-fake/gpus.json
    : > /var/lib/gpuwarden-fake/kmsg
    install_ckpt_key
    if [ "${GPUWARDEN_SITE:-fsx}" = fsx ]; then
        install -d -m 0755 /fsx/.canary && echo ok > "/fsx/.canary/$(hostname)"
    else
        no_fsx
    fi
    exec slurmd -D
    ;;
s3)
    mkdir -p /var/lib/seaweedfs
    exec weed server -dir=/var/lib/seaweedfs -ip=s3 -ip.bind=0.0.0.0 -volume.max=0 \
        -master.volumeSizeLimitMB=256 -s3 -s3.port=8333 -s3.config="$state/s3.json"
    ;;
*)
    echo "unknown role $role" >&2
    exit 2
    ;;
esac
