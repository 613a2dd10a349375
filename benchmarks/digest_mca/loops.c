#include <stdint.h>
#include <string.h>
static const uint64_t GOLDEN = 0x9E3779B97F4A7C15ULL;
static inline uint64_t fmix64(uint64_t x){x^=x>>33;x*=0xff51afd7ed558ccdULL;x^=x>>33;x*=0xc4ceb9fe1a85ec53ULL;x^=x>>33;return x;}
uint64_t old_loop(const unsigned char *p, uint64_t n, uint64_t first){uint64_t s=0;for(uint64_t i=0;i<n;i++){uint64_t w;memcpy(&w,p+8*i,8);s+=fmix64(w+(first+i+1)*GOLDEN);}return s;}
uint64_t new_loop(const unsigned char *p, uint64_t n, uint64_t first){uint64_t s=0,o=(first+1)*GOLDEN;for(uint64_t i=0;i<n;i++){uint64_t w;memcpy(&w,p+8*i,8);s+=fmix64(w+o);o+=GOLDEN;}return s;}
float sum_loop(const float *p, uint64_t n){float s=0;for(uint64_t i=0;i<n;i++)s+=p[i];return s;}
