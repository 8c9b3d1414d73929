/* The host around the GPUs, read from sysfs: how many GPUs share it, which NUMA node each sits on. */
#ifndef TMS_TOPOLOGY_H
#define TMS_TOPOLOGY_H

#include <stddef.h>

/* sysfs as the kernel mounts it; tests pass a tree of their own. */
#define TMS_SYSFS "/sys"

/* GPUs on the host, whichever process they are visible to (NVIDIA or AMD
 * PCI functions of class display or processing accelerator); 0 if sysfs
 * cannot tell. Counts what sysfs shows: SR-IOV virtual functions, GPUs passed
 * to virtual machines and a workstation's display GPU too. */
int tms_topology_host_gpus(const char *sysfs);

/* NUMA node of the PCI device bus_id ("0000:3b:00.0", any case, a domain
 * of 4 or 8 hex digits); -1 where unknown (one node, or no such device). */
int tms_topology_pci_numa_node(const char *sysfs, const char *bus_id);

/* Asks the kernel to place the pages of [p, p + size), not yet touched, on
 * node (MPOL_PREFERRED: elsewhere when the node is full). 0 or an errno. */
int tms_topology_prefer_node(void *p, size_t size, int node);

#endif
