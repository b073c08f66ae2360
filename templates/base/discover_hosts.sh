#!/bin/sh
# Host discovery for elastic horovodrun: print one "host:slots" line per available host.
# horovodrun calls this every few seconds; hosts that appear join, hosts that vanish leave.
#
# Set HVD_HOSTS to your hosts, e.g. HVD_HOSTS="node1:4 node2:4". On Kubernetes the MPI
# Operator provides /etc/mpi/discover_hosts.sh; use that instead.
#
# By default this lists this machine twice, under two names. Horovod blacklists a whole host
# when one of its workers fails; two names let the job go on with the survivor.
if [ -n "${HVD_HOSTS:-}" ]; then
  for host in $HVD_HOSTS; do echo "$host"; done
else
  echo "localhost:1"
  echo "127.0.0.1:1"
fi
