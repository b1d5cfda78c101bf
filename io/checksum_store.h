// Checksums on everything a store writes and reads back.
//
// CreateChecksummingStore wraps a BlockStore. When a write completes, it hashes the bytes that
// were written (the buffer is still the caller's and unchanged: the BlockStore contract) and
// remembers the hash for that range of the file. When a read of exactly such a range completes,
// it hashes what came back and compares: a difference completes the read with DataLoss naming the
// paths, the offset, the length and both hashes, instead of handing corrupted bytes to the caller.
// A read of a range this store never wrote (or only partly overwrote since) is passed through
// unchecked and counted (StoreStats::checksum_unverified_reads).
//
// The hash is XXH3-64 (libxxhash), computed on the inner store's I/O threads inside the
// completion callbacks, so Submit stays as cheap as the inner store's and the hashing of one
// request overlaps the transfers of the others. Its cost is reported by `strata nvme-bench`
// against the drive's bandwidth (docs/io.md).
//
// The hashes live in memory: they protect data between a write and a read by the same process
// (offload swap files). Durable data (checkpoints) carries its checksums in a manifest instead.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "strata/block_store.h"

namespace strata::io {

std::unique_ptr<BlockStore> CreateChecksummingStore(std::unique_ptr<BlockStore> inner);

// XXH3-64 of `bytes` (the hash the store uses; also the checkpoint manifest's).
uint64_t Checksum64(std::span<const std::byte> bytes);

// The same hash over bytes that arrive in pieces: Update in order, then Digest (which equals
// Checksum64 of the concatenation).
class Checksum64Stream {
 public:
  Checksum64Stream();
  ~Checksum64Stream();
  Checksum64Stream(const Checksum64Stream&) = delete;
  Checksum64Stream& operator=(const Checksum64Stream&) = delete;
  void Update(const void* data, size_t size);
  uint64_t Digest() const;

 private:
  void* state_;  // XXH3_state_t
};

// "0123456789abcdef": the 16 hex digits a manifest stores.
std::string ChecksumHex(uint64_t checksum);

}  // namespace strata::io
